"""(d), the alternative: the same config in Hugging Face transformers (PyTorch), same lengths.

    python -m benchmarks.device.hf --out hf.json [--smoke] [--quick] [--budget S]

`DeepseekV2ForCausalLM` of `DeepseekV2Config(**config)` (the dict the JAX side builds its
`MLAConfig` from), made on the GPU (CUDA; the CPU in the smoke) in bf16, every weight drawn
afresh as ours are (norms 1, everything else uniform with standard deviation 0.02, routers
included, so both sides spread tokens over the experts alike). transformers' own attention and
experts implementations (recorded, and named in each row's `path`) and its own KV cache. Timed,
each until the device is synchronised:

- decode C (first, as on our side): one forward of C x `decode_context` tokens fills the
  cache, then steps of one token per sequence on that cache, median of `decode_steps` after
  `decode_warmup`;
- prefill T: one forward of T tokens (`use_cache=True`, logits of the last position only),
  median of `repeats` after one warm-up.

No jax here: the GPU's memory is this process's alone while it runs.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import statistics
import time

import numpy as np

from benchmarks.device import report
from benchmarks.device.shapes import sizes


def build(hf_config: dict, device):
    """The random bf16 model on `device`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    kwargs = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(DeepseekV2Config(**kwargs), dtype=torch.bfloat16)
    half = hf_config["initializer_range"] * 3**0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.uniform_(-half, half)
    return model.to(device).eval()


class Runs:
    """Timed forwards of `model` on random token ids, each until the device is synchronised."""

    def __init__(self, model, sz, device, cuda: bool):
        self.model, self.sz, self.device, self.cuda = model, sz, device, cuda
        self.rng = np.random.default_rng(0)
        # transformers renamed the cache argument (`past_key_values` -> `cache`) after 5.17
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def tokens(self, *shape):
        import torch

        ids = self.rng.integers(0, self.sz.hf["vocab_size"], shape)
        return torch.as_tensor(ids, device=self.device)

    def timed(self, fn) -> tuple[float, object]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    def forward(self, ids, cache=None):
        kw = {self.cache_arg: cache} if cache is not None else {}
        out = self.model(ids, use_cache=True, logits_to_keep=1, **kw)
        return out, out["cache"] if "cache" in out else out["past_key_values"]

    def decode(self, c: int) -> list[float]:
        """Seconds of each timed step of c sequences of `decode_context` tokens (after the
        warm-up steps)."""
        sz = self.sz
        _, cache = self.forward(self.tokens(c, sz.decode_context))
        step, samples = self.tokens(c, 1), []
        for _ in range(sz.decode_warmup + sz.decode_steps):
            dt, (_, cache) = self.timed(lambda cache=cache: self.forward(step, cache))
            samples.append(dt)
        return samples[sz.decode_warmup :]

    def prefill(self, t: int) -> list[float]:
        """Seconds of each timed forward of t tokens (after one warm-up)."""
        prompt = self.tokens(1, t)
        return [self.timed(lambda: self.forward(prompt))[0] for _ in range(1 + self.sz.repeats)][1:]


def row(kind: str, size: int, samples: list[float], path: str) -> dict:
    med = statistics.median(samples)
    return dict(kind=kind, size=size, path=path, time_s=med, tok_s=size / med, samples_s=samples)


def main(argv=None) -> None:
    args = report.parser(__doc__.splitlines()[0]).parse_args(argv)
    sz = sizes(args.smoke, args.quick)
    with report.Part("hf", args) as part:
        import torch

        cuda = torch.cuda.is_available() and not args.smoke
        device = torch.device("cuda" if cuda else "cpu")
        if not cuda:  # the smoke: one thread (threads spinning beside CI's other worker cost
            # a tiny model's step 100x); a CPU-only run: every core
            torch.set_num_threads(1 if args.smoke else os.cpu_count() or 1)
        model = build(sz.hf, device)
        dev = dict(torch_device=str(next(model.parameters()).device))
        dev |= dict(name=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
        dev |= dict(transformers=importlib.metadata.version("transformers"))
        cfg = dict(layers=sz.hf["num_hidden_layers"], weights="bfloat16")
        names = ("attn_implementation", "experts_implementation")  # transformers' choices
        cfg |= {k: getattr(model.config, f"_{k}", None) for k in names}
        part.set(device=dev, config=cfg | dict(decode_context=sz.decode_context))
        path = "/".join(str(cfg[k]) for k in names)  # attention / experts, as transformers chose
        runs = Runs(model, sz, device, cuda)
        with torch.inference_mode():
            for c in part.each(sz.decode_batches, "decode {}"):
                part.add(row("decode", c, runs.decode(c), path))
            for t in part.each(sz.prefill_lengths, "prefill {}"):
                part.add(row("prefill", t, runs.prefill(t), path))


if __name__ == "__main__":
    main()
