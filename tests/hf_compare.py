"""Shared harness: build tiny real checkpoints with transformers, compare npumoe against them.

transformers is the independent truth here: npumoe never calls it, the tests do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import npumoe

transformers = __import__("pytest").importorskip("transformers")

LOGIT_TOL = 1e-4


def build_checkpoint(config, path: Path, layout: str = "native", seed: int = 0, jitter: float = 0.05, prepare=None):
    """Save a randomly initialised model; every parameter is jittered so that biases, norm
    weights and zero-initialised routers are non-trivial. ``layout="stacked"`` writes the
    in-memory state dict as is (3-D stacked expert tensors) instead of the on-disk format.
    ``prepare(model)`` runs after the jitter, to set what it skips (buffers, chosen values)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * jitter)
        if prepare is not None:
            prepare(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if layout == "stacked":
        for f in path.glob("*.safetensors"):
            f.unlink()
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"))
    return model


def edit_config(path: Path, **changes) -> None:
    """Rewrite config.json keys (None deletes): to test other spellings of the same config."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg, indent=2))


def hf_routing(hf_model, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """HF logits [T, V] and, per MoE layer in order, the expert indices its router chose."""
    picks: list[np.ndarray] = []
    routers = [m for m in hf_model.modules() if type(m).__name__.lower().endswith("router")]
    hooks = [r.register_forward_hook(lambda _m, _i, out: picks.append(out[2].detach().numpy())) for r in routers]
    try:
        with torch.no_grad():
            logits = hf_model(torch.tensor(ids)[None]).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, picks


def hf_greedy(hf_model, ids: np.ndarray, n: int) -> np.ndarray:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(ids)[None], max_new_tokens=n, do_sample=False, min_new_tokens=0)
    return out[0, len(ids):].numpy()


def assert_matches(model_dir: Path, hf_model, prompt_len: int = 13, chunk: int = 8, n_gen: int = 16, seed: int = 1):
    """The foundation's contract against transformers, for one checkpoint."""
    assert prompt_len % chunk != 0, "use a prompt that is not a multiple of the chunk"
    model = npumoe.load(model_dir)
    routed: dict[int, list[np.ndarray]] = {}
    eng = npumoe.Engine(model, chunk=chunk, on_route=lambda i, e, w, a: routed.setdefault(i, []).append(e.numpy()))
    ids = np.random.default_rng(seed).integers(0, model.spec.vocab_size, prompt_len)

    ours = eng.forward(ids)
    ref, ref_picks = hf_routing(hf_model, ids)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=LOGIT_TOL, rtol=0)

    moe_layers = model.spec.moe_layers
    assert sorted(routed) == moe_layers and len(ref_picks) == len(moe_layers)
    for layer, ref_idx in zip(moe_layers, ref_picks):
        mine = np.concatenate(routed[layer])
        np.testing.assert_array_equal(np.sort(mine, axis=1), np.sort(ref_idx.reshape(mine.shape), axis=1))

    new, step_logits = eng.generate(ids, max_new_tokens=n_gen, return_logits=True)
    np.testing.assert_array_equal(new, hf_greedy(hf_model, ids, n_gen))
    full = eng.forward(np.concatenate([ids, new[:-1]]))  # recompute every position at once
    np.testing.assert_allclose(step_logits, full[prompt_len - 1:], atol=LOGIT_TOL, rtol=0)
    return model
