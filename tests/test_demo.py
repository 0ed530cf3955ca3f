"""The `make run` demo: greedy decode through the paged cache equals full-sequence greedy."""

from __future__ import annotations

import numpy as np

import leyline_jax as ll
from serve import demo


def test_greedy_paged_equals_full_recompute(np_ckpt):
    model = ll.load_model(np_ckpt("glm4_moe_lite"))
    prompt = np.random.default_rng(1).integers(0, 256, 21).tolist()
    tokens, timings = demo.greedy(model, prompt, 5)
    seq = list(prompt)
    for _ in range(5):
        seq.append(int(np.asarray(model(np.asarray(seq)))[-1].argmax()))
    assert tokens == seq[len(prompt) :]
    assert timings["first_call_s"] > 0


def test_main_writes_and_runs(tmp_path, capsys):
    demo.main(["--root", str(tmp_path), "--prompt-len", "8", "--new", "2"])
    out = capsys.readouterr().out
    for family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
        assert family in out and (tmp_path / family / "model.safetensors").is_file()
