"""Estimated tokens/s of a planned model on phone and laptop NPUs: a roofline with launch costs.

Decode reads every weight a token touches once, so a decode step costs its weight bytes over the
device's DRAM bandwidth plus one launch cost per graph it runs; prefill does ~2 FLOPs per active
parameter per token, so a chunk costs the larger of its compute time at the NPU's peak and its weight
traffic, plus its launches. Every device number carries its public source; a number nobody published
(launch costs) says so. These are estimates, labelled as such wherever they are shown, and
:data:`PUBLISHED` holds figures the model was not fitted to, so ``npumoe compare`` prints how far off
it is — a cost model nobody checks is a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Device:
    name: str
    npu: str  # "htp" or "ane": which npumoe target runs on it
    npu_tops: float  # peak NPU int8 (Qualcomm) / ANE (Apple: as marketed, fp16 ops) tera-operations per second
    dram_gb_s: float  # what the NPU can stream from DRAM
    launch_us: float  # one graph launch, host round trip included
    sources: tuple[tuple[str, str], ...]  # (field, where the number comes from)

    def source(self, field: str) -> str:
        return dict(self.sources)[field]


UNPUBLISHED_LAUNCH = "no public figure: npumoe's order-of-magnitude estimate (see the backend's Capabilities)"

DEVICES = (
    Device("Snapdragon 8 Gen 3", "htp", 45.0, 59.0, 300.0, (
        ("npu_tops", "third-party listing, runlocalai.co/hardware/snapdragon-8-gen-3 (Qualcomm publishes only "
                     "'98% faster than 8 Gen 2')"),
        ("dram_gb_s", "T-MAN (arXiv 2025), Table 2: NPU DMA bandwidth measured on a OnePlus 12; LPDDR5X-4800 "
                      "peaks at 76.8 GB/s"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Snapdragon 8 Elite", "htp", 65.0, 84.8, 300.0, (
        ("npu_tops", "estimate: 8 Gen 3's figure x 1.45 (Qualcomm: Hexagon NPU '45% faster', Snapdragon 8 "
                     "Elite product brief, qualcomm.com)"),
        ("dram_gb_s", "LPDDR5X-5300 x 64 bit, Snapdragon 8 Elite product brief (qualcomm.com); peak, not measured"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Apple M2", "ane", 15.8, 100.0, 200.0, (
        ("npu_tops", "Apple newsroom, 'Apple unveils M2' (2022-06-06): Neural Engine 15.8 trillion ops/s"),
        ("dram_gb_s", "Apple newsroom, 'Apple unveils M2' (2022-06-06): 100 GB/s unified memory bandwidth"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Apple M4", "ane", 38.0, 120.0, 200.0, (
        ("npu_tops", "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 38 trillion ops/s"),
        ("dram_gb_s", "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 120 GB/s"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Apple M4 Max", "ane", 38.0, 546.0, 200.0, (
        ("npu_tops", "Apple newsroom, MacBook Pro with M4 family (2024-10-30): the M4 family's 38 TOPS Neural Engine"),
        ("dram_gb_s", "Apple newsroom, MacBook Pro with M4 family (2024-10-30): M4 Max 546 GB/s"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Apple A17 Pro", "ane", 35.0, 51.2, 200.0, (
        ("npu_tops", "Apple newsroom, iPhone 15 Pro (2023-09-12): Neural Engine up to 35 trillion ops/s"),
        ("dram_gb_s", "third-party: LPDDR5-6400 x 64 bit (teardown reports); Apple does not publish it"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
    Device("Apple A18", "ane", 35.0, 60.0, 200.0, (
        ("npu_tops", "Apple newsroom, iPhone 16 (2024-09-09): 16-core Neural Engine, 35 trillion ops/s class"),
        ("dram_gb_s", "third-party: LPDDR5X-7500 x 64 bit (teardown reports); Apple does not publish it"),
        ("launch_us", UNPUBLISHED_LAUNCH))),
)


@dataclass(frozen=True)
class Workload:
    """What one token costs a planned model, from its plan and spec (see :func:`npumoe.core.targets`)."""

    decode_weight_bytes: float  # weights one decode token reads (dense graphs + the experts it hits)
    decode_launches: float  # graph launches per decode step
    prefill_flops_per_token: float  # 2 x active parameters
    chunk: int
    chunk_weight_bytes: float  # weights one prefill chunk reads
    chunk_launches: float  # graph launches per prefill chunk


@dataclass(frozen=True)
class Estimate:
    device: str
    decode_tok_s: float
    prefill_tok_s: float


def launch_seconds(device: Device, flops: float, weight_bytes: float, launches: float = 1.0) -> float:
    """Graph launches that do ``flops`` and read ``weight_bytes`` between them: the larger of compute at the NPU's
    peak and weight traffic at its DRAM bandwidth, plus each launch's cost."""
    compute, traffic = flops / (device.npu_tops * 1e12), weight_bytes / (device.dram_gb_s * 1e9)
    return max(compute, traffic) + launches * device.launch_us * 1e-6


def estimate(device: Device, work: Workload) -> Estimate:
    decode = launch_seconds(device, 0.0, work.decode_weight_bytes, work.decode_launches)
    chunk = launch_seconds(device, work.chunk * work.prefill_flops_per_token, work.chunk_weight_bytes,
                           work.chunk_launches)
    return Estimate(device.name, 1 / decode, work.chunk / chunk)


@dataclass(frozen=True)
class Published:
    """A figure someone measured, and the workload it implies, to hold the model against."""

    device: str
    label: str
    assumptions: str  # what the workload below takes the figure to mean
    decode_tok_s: float
    weight_bytes_per_token: float
    launches_per_token: float
    source: str


PUBLISHED = (
    Published("Snapdragon 8 Gen 3", "T-MAN, BitNet-2B decode", "2.08 B ternary weights at 2 bits plus an 8-bit tied "
              "128k x 2560 head (our assumption), one ExecuTorch program a token", 49.1, 0.85e9, 1,
              "T-MAN (arXiv 2025), section 6: 49.1 tokens/s on BitNet-2B, Snapdragon 8 Gen 3 (npumoe seeds)"),
    Published("Snapdragon 8 Gen 3", "Qualcomm: a 7B LLM decode", "Llama-2-7B at 4 bits (~3.4 GB a token, our "
              "assumption), 4 context binaries", 20.0, 3.4e9, 4,
              "Qualcomm at Snapdragon Summit 2023 ('up to 20 tokens/sec'), via fonearena.com"),
    Published("Apple M4 Max", "ZAYA1-8B MoE on the ANE", "all 8 experts computed every step; fp16 weights (our "
              "assumption: ~16 GB a token; at 4 bits the ratio would be 4x larger), 4 shards", 9.0, 16e9, 4,
              "ANE MoE chapter (npumoe seeds, ane-moe-chapter.txt): 9 tok/s on M4 Max"),
)


def check_published() -> list[dict]:
    """Each published figure beside the model's estimate for the same workload: estimate / published."""
    rows = []
    for fig in PUBLISHED:
        device = next(d for d in DEVICES if d.name == fig.device)
        work = Workload(fig.weight_bytes_per_token, fig.launches_per_token, 0.0, 1, fig.weight_bytes_per_token,
                        fig.launches_per_token)
        est = estimate(device, work).decode_tok_s
        rows.append({"device": fig.device, "label": fig.label, "assumptions": fig.assumptions,
                     "published_tok_s": fig.decode_tok_s,
                     "estimate_tok_s": est, "ratio": est / fig.decode_tok_s, "source": fig.source})
    return rows


def workload(spec, plan, chunk_launches: float) -> Workload:
    """A planned model's per-token costs at fp16 weights: dense graphs, and the expert graphs a decode token
    launches (whole, as the plan cut them: its expected figures; the top-k experts in plans made before); a
    prefill chunk reads every expert (at real chunk sizes nearly all are hit) and launches what was measured
    (``chunk_launches``)."""
    from npumoe.core.plan import expert_bytes
    from npumoe.core.weights import expected_shapes

    params = {n: float(np.prod(s)) for n, s in expected_shapes(spec).items() if n != "embed.weight"}
    params.setdefault("lm_head.weight", float(spec.vocab_size * spec.hidden_size))  # a tied head is still read
    dense = 2 * sum(p for n, p in params.items() if ".moe.experts." not in n)
    every = sum(spec.layers[i].ffn.num_experts * expert_bytes(spec, i) for i in spec.moe_layers)
    hit = expert_launches = 0.0
    for i, lp in plan.layers.items():
        if "decode_weight_mb" in lp.predicted:
            hit += lp.predicted["decode_weight_mb"] * 1e6
            expert_launches += lp.predicted["decode_launches"]
        else:
            hit += spec.layers[i].ffn.top_k * expert_bytes(spec, i)
            expert_launches += min(spec.layers[i].ffn.top_k, sum(g.residency == "npu" for g in lp.groups))
    return Workload(decode_weight_bytes=dense + hit, decode_launches=spec.num_layers + 1 + expert_launches,
                    prefill_flops_per_token=dense + hit,  # 2 FLOPs per active parameter = its fp16 bytes
                    chunk=plan.chunk, chunk_weight_bytes=dense + every, chunk_launches=chunk_launches)
