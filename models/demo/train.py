"""Train the shipped demo model: a small Qwen3-MoE byte-level LM on Python's standard library.

    python -m npumoe.models.demo.train                                        # the shipped model
    python -m npumoe.models.demo.train --steps 3 --max-files 5 --batch 2 --out /tmp/demo   # smoke run

Its point is realistic routing: trained routers are skewed (random ones are not), which is what
calibration and planning must handle. The load-balancing loss is Switch-style and per layer:
E · Σ_e f_e · P_e for each layer (f: fraction of that layer's top-k picks going to expert e,
P: its mean router probability; 1.0 when balanced), averaged over layers, weighted 0.01.
(transformers' own aux loss pools f and P over all layers, so it is not per layer.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from npumoe.models.demo import corpus

HERE = Path(__file__).parent
ARCH = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-6,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, router_aux_loss_coef=0.01,
)  # fmt: skip
AUX_COEF = 0.01
TOKENIZER_MARKER = {"kind": "bytes"}  # npumoe's byte tokenizer: token id = byte value


def make_model(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**ARCH)
    config._attn_implementation = "eager"
    return Qwen3MoeForCausalLM(config)


def balance_loss(router_logits, top_k: int) -> torch.Tensor:
    """Per layer E · Σ_e f_e · P_e (Switch Transformer eq. 4, top-k picks), mean over layers."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        experts = probs.shape[-1]
        picks = F.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(dim=1).float()  # [tokens, E]
        losses.append(experts * (picks.mean(0) / top_k * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def windows(data: np.ndarray, starts, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([data[s:s + length] for s in starts]).astype(np.int64))


@torch.no_grad()
def bits_per_byte(model, held: np.ndarray, seq: int, n: int = 64) -> float:
    """Mean next-byte cross-entropy (nats / ln 2) over n evenly spaced held-out windows."""
    batch = windows(held, np.linspace(0, len(held) - seq - 1, n).astype(int), seq + 1)
    logits = model(batch[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))) / math.log(2)


@torch.no_grad()
def imbalance(model, held_docs: dict[str, str], chunk: int = 64, window: int = 512, n: int = 64) -> list[float]:
    """Per layer r = mean over chunks of max/mean tokens per expert (each top-k pick counted).

    Held-out documents are cut into windows of `window` bytes, n of them evenly spaced; each is
    prefilled from scratch and its routing split into full chunks of `chunk` tokens.
    """
    docs = [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in held_docs.values()]
    pieces = [d[s:s + window] for d in docs for s in range(0, len(d) - chunk + 1, window)]
    pieces = [pieces[i] for i in np.unique(np.linspace(0, len(pieces) - 1, n).astype(int))]
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    ratios = [[] for _ in range(model.config.num_hidden_layers)]
    for piece in pieces:
        piece = piece[: len(piece) // chunk * chunk]
        out = model(torch.from_numpy(piece.astype(np.int64))[None], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            picks = logits.topk(k, dim=-1).indices.reshape(-1, chunk * k)  # [chunks, chunk·k]
            loads = F.one_hot(picks, experts).sum(dim=1).float()  # [chunks, E]
            ratios[layer] += (loads.max(dim=1).values / loads.mean(dim=1)).tolist()
    return [round(float(np.mean(r)), 3) for r in ratios]


def train(steps: int, out: Path, seed: int, batch: int, seq: int, lr: float, max_files: int | None) -> dict:
    train_docs, held_docs = corpus.split(max_files)
    data = np.frombuffer(corpus.to_bytes(train_docs), dtype=np.uint8)
    held = np.frombuffer(corpus.to_bytes(held_docs), dtype=np.uint8)
    model = make_model(seed)
    rng = np.random.default_rng(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    cosine = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine)

    losses, aux_losses = [], []
    load_before, start = os.getloadavg()[0], time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("training", total=steps)
        for _ in range(steps):
            ids = windows(data, rng.integers(0, len(data) - seq - 1, batch), seq + 1)
            outputs = model(ids[:, :-1], output_router_logits=True)
            ce = F.cross_entropy(outputs.logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
            aux = balance_loss(outputs.router_logits, model.config.num_experts_per_tok)
            opt.zero_grad(set_to_none=True)
            (ce + AUX_COEF * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(ce.item())
            aux_losses.append(aux.item())
            bar.update(task, advance=1, description=f"training  loss {losses[-1]:.3f}  aux {aux_losses[-1]:.3f}")
    seconds = time.perf_counter() - start

    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # nothing in it a byte LM needs
    (out / "npumoe_tokenizer.json").write_text(json.dumps(TOKENIZER_MARKER) + "\n")
    import transformers

    tail = max(1, min(20, steps))
    return {
        "architecture": "Qwen3MoeForCausalLM",
        "layers": model.config.num_hidden_layers, "experts": model.config.num_experts,
        "top_k": model.config.num_experts_per_tok, "hidden": model.config.hidden_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {
            "source": f"Python {platform.python_version()} stdlib .py + pydoc_data.topics, split by document",
            "train_sha256": corpus.digest(train_docs), "heldout_sha256": corpus.digest(held_docs),
            "train_files": sum(k.startswith("stdlib/") for k in train_docs),
            "heldout_files": sum(k.startswith("stdlib/") for k in held_docs),
            "train_topics": sum(k.startswith("pydoc/") for k in train_docs),
            "heldout_topics": sum(k.startswith("pydoc/") for k in held_docs),
            "train_bytes": int(len(data)), "heldout_bytes": int(len(held)), "max_files": max_files,
        },
        "steps": steps, "batch": batch, "seq_len": seq, "lr": lr, "warmup_steps": warmup, "seed": seed,
        "optimizer": "AdamW(betas 0.9/0.95, wd 0.1 on matrices), cosine to 0.1·lr, grad clip 1.0",
        "aux_loss": f"per-layer Switch balance loss E·Σ f·P, mean over layers, coefficient {AUX_COEF}",
        "train_seconds": round(seconds, 1),
        "loadavg_1min_start_end": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "first_train_loss": round(losses[0], 4),
        "final_train_loss": round(float(np.mean(losses[-tail:])), 4),  # nats/byte, mean of the last 20 steps
        "final_aux_loss": round(float(np.mean(aux_losses[-tail:])), 4),
        "heldout_bits_per_byte": round(bits_per_byte(model, held, seq), 4),
        "imbalance_r_chunk64": imbalance(model, held_docs),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
    }  # fmt: skip


def write_card(out: Path, card: dict) -> None:
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    c, r = card["corpus"], ", ".join(f"L{i} {v}" for i, v in enumerate(card["imbalance_r_chunk64"]))
    (out / "CARD.md").write_text(f"""# npumoe demo model

A Qwen3-MoE-architecture byte-level LM (token id = byte value; vocab 256, hidden 128, {card['layers']} layers,
4 query / 2 kv heads × 32, {card['experts']} experts top-{card['top_k']}, expert width 256, tied embeddings,
{card['parameters']:,} parameters), trained by `models/demo/train.py` on {c['source']}
(held-out documents are never trained on). It exists to route like a real MoE: skewed, not uniform.
No BOS/EOS/pad: generation runs to the token limit.

- training: {card['steps']} steps × batch {card['batch']} × {card['seq_len']} bytes, seed {card['seed']},
  {card['train_seconds']} s on 2 CPU threads (1-min load average at start/end {card['loadavg_1min_start_end']})
- final train loss {card['final_train_loss']} nats/byte (mean of last 20 steps)
- held-out bits per byte: **{card['heldout_bits_per_byte']}**
- routing imbalance r = max/mean expert load over 64-token held-out chunks: {r}
- load balancing: {card['aux_loss']}
  (transformers' built-in aux loss pools all layers together, so it is not used)
- corpus: {c['train_files']} files + {c['train_topics']} topics train ({c['train_bytes']:,} bytes),
  {c['heldout_files']} files + {c['heldout_topics']} topics held out ({c['heldout_bytes']:,} bytes)
- train sha256 `{c['train_sha256']}`
- held-out sha256 `{c['heldout_sha256']}`
- transformers {card['versions']['transformers']}, torch {card['versions']['torch']}, \
Python {card['versions']['python']}
""")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-files", type=int, default=None, help="first N documents of each split (smoke runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    card = train(args.steps, args.out, args.seed, args.batch, args.seq, args.lr, args.max_files)
    write_card(args.out, card)
    print(json.dumps({k: card[k] for k in ("final_train_loss", "heldout_bits_per_byte", "imbalance_r_chunk64")}))
    return card


if __name__ == "__main__":
    main()
