"""(d), the alternative: the same config in Hugging Face transformers (PyTorch), same lengths.

    python -m benchmarks.device.hf --out hf.json [--smoke] [--budget S]

`DeepseekV2ForCausalLM` of `DeepseekV2Config(**config)` (the dict the JAX side builds its
`MLAConfig` from), made on the GPU (CUDA; the CPU in the smoke) in bf16, every weight drawn
afresh as ours are (norms 1, everything else uniform with standard deviation 0.02, routers
included, so both sides spread tokens over the experts alike). transformers' own attention and
experts implementations (recorded) and its own KV cache. Timed, each until the device is
synchronised:

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


def main(argv=None) -> None:
    args = report.parser(__doc__.splitlines()[0]).parse_args(argv)
    sz = sizes(args.smoke)
    with report.Part("hf", args) as part:
        import torch

        cuda = torch.cuda.is_available() and not args.smoke
        device = torch.device("cuda" if cuda else "cpu")
        if not cuda:
            torch.set_num_threads(os.cpu_count() or 1)

        def sync():
            if cuda:
                torch.cuda.synchronize()

        model = build(sz.hf, device)
        # transformers renamed the cache argument (`past_key_values` -> `cache`) after 5.17
        params = inspect.signature(model.forward).parameters
        cache_arg = "cache" if "cache" in params else "past_key_values"
        part.set(
            device=dict(
                torch_device=str(next(model.parameters()).device),
                name=torch.cuda.get_device_name() if cuda else "cpu",
                torch=torch.__version__,
                transformers=importlib.metadata.version("transformers"),
            ),
            config=dict(
                layers=sz.hf["num_hidden_layers"],
                weights="bfloat16",
                attn_implementation=getattr(model.config, "_attn_implementation", None),
                experts_implementation=getattr(model.config, "_experts_implementation", None),
                decode_context=sz.decode_context,
            ),
        )
        rng = np.random.default_rng(0)
        vocab = sz.hf["vocab_size"]

        def tokens(*shape):
            return torch.as_tensor(rng.integers(0, vocab, shape), device=device)

        def timed(fn) -> tuple[float, object]:
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            return time.perf_counter() - t0, out

        def forward(ids, cache=None):
            kw = {cache_arg: cache} if cache is not None else {}
            return model(ids, use_cache=True, logits_to_keep=1, **kw)

        def cache_of(out):
            return out["cache"] if "cache" in out else out["past_key_values"]

        with torch.inference_mode():
            for c in sz.decode_batches:
                if part.out_of_time():
                    part.skip(f"decode {c}: out of time")
                    continue
                cache = cache_of(forward(tokens(c, sz.decode_context)))
                step = tokens(c, 1)
                samples = []
                for _ in range(sz.decode_warmup + sz.decode_steps):
                    dt, out = timed(lambda cache=cache, step=step: forward(step, cache))
                    cache = cache_of(out)
                    samples.append(dt)
                med = statistics.median(samples[sz.decode_warmup :])
                part.add(
                    dict(
                        kind="decode",
                        size=c,
                        time_s=med,
                        tok_s=c / med,
                        samples_s=samples[sz.decode_warmup :],
                    )
                )
                del cache, out
            for t in sz.prefill_lengths:
                if part.out_of_time():
                    part.skip(f"prefill {t}: out of time")
                    continue
                prompt = tokens(1, t)
                samples = [timed(lambda p=prompt: forward(p))[0] for _ in range(1 + sz.repeats)]
                med = statistics.median(samples[1:])
                part.add(
                    dict(kind="prefill", size=t, time_s=med, tok_s=t / med, samples_s=samples[1:])
                )


if __name__ == "__main__":
    main()
