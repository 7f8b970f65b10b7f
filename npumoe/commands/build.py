"""`npumoe build`: every target from one model spec (``--targets``), or one planned target's artifacts."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

import click
from rich.console import Console
from rich.table import Table

from npumoe.commands.options import (
    build_options,
    chosen_build_options,
    dtype_option,
    model_option,
    options_per_target,
    target_option,
)
from npumoe.commands.plan import read_texts
from npumoe.core.base.errors import InputError
from npumoe.core.planning import GRAPHS_PER_LAYER, RESIDENCY


@click.command("build")
@model_option
@dtype_option
@click.option("--targets", default=None, help="Every vendor in one go: comma-separated NPU targets (e.g. htp,ane). "
                                              "Calibrates once on --text, plans each target from its own "
                                              "Capabilities, builds each into OUT/TARGET and validates each "
                                              "against the fp32 reference on held-out text.")
@click.option("--text", "text_files", multiple=True, type=click.Path(),
              help="--targets: calibration text file (repeatable) [default: Python's pydoc topics].")
@click.option("--heldout", "heldout_file", default=None, type=click.Path(),
              help="--targets: text to validate on [default: the last --text file (with one, its last tenth), "
                   "which is then left out of calibration].")
@click.option("--chunk", default=64, show_default=True, type=click.IntRange(1),
              help="--targets: prefill chunk size the graphs are built for.")
@click.option("--residency", type=click.Choice(RESIDENCY), default="auto", show_default=True,
              help="--targets: expert groups on the NPU where a launch pays (auto), or all (npu) / none (cpu).")
@click.option("--graphs-per-layer", default=GRAPHS_PER_LAYER, show_default=True, type=click.IntRange(1),
              help="--targets: compiled expert graphs per layer, shared by its groups (more shapes to fit each "
                   "chunk's routing: less padding, longer builds).")
@click.option("--plan", "plan_path", default=None, type=click.Path(), help="One target: a plan from npumoe plan.")
@target_option(None, "One target: where the artifacts will run.", npu_only=True, required=False)
@click.option("--out", required=True, type=click.Path(), help="Artifact directory (replaced only when complete).")
@click.option("--max-context", default=512, show_default=True, type=click.IntRange(1),
              help="KV cache length compiled into the attention graphs.")
@click.option("--layers", default=None, help="Build only these layers' graphs, e.g. 0 or 0-3,7: a quick look at a "
                                             "large model (the result does not run).")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(1),
              help="Compile this many units (graphs; ANE: packages) at once, each in its own process: faster on a "
                   "machine with cores and memory to spare (each holds one unit's weights while it compiles).")
@click.option("--cluster", default=None, metavar="ADDRESS",
              help="Compile the units on a Ray cluster instead: ray://HOST:10001 (from anywhere), HOST:6379 (on one "
                   "of its nodes) or auto (RAY_ADDRESS). Every node needs this npumoe, the toolchains, and the "
                   "model and --cache at the same paths (pip install 'npumoe[cluster]').")
@click.option("--cache", "cache_dir", default=None, type=click.Path(),
              help="Build cache directory or file:// URL [default: $NPUMOE_BUILD_CACHE, else "
                   "~/.cache/npumoe/builds]; with --cluster, one on a file system every node mounts at this path "
                   "(NFS, say; object stores such as s3:// cannot hold it).")
@build_options
def build_command(model_dir, dtype, targets, text_files, heldout_file, chunk, residency, graphs_per_layer, plan_path,
                  target, out, max_context, layers, jobs, cluster, cache_dir, **options):
    """Compile a model's NPU graphs: every target from one spec (--targets), or one planned target.

    \b
    Examples:
      npumoe build --targets htp,ane --text prompts.txt --out build     # calibrate, plan, build, validate
      npumoe generate --artifacts build --target ane                    # run one of them
      npumoe build --plan plan.json --target htp --precision w8a16 --out build/htp
    """
    if targets is not None and (plan_path or target or layers):
        raise InputError("--targets calibrates and plans for you: give it without --plan, --target or --layers.")
    if targets is None and not (plan_path and target):
        raise InputError("give --targets htp,ane (every target from one calibration), or --plan and --target.")
    if cluster and jobs != 1:
        raise InputError("--jobs sets the processes on this machine; with --cluster each node's CPUs do: drop --jobs.")
    with build_cache_at(cache_dir), lowering(jobs, cluster) as where:
        if targets is not None:
            return build_every_target(model_dir, dtype, targets, text_files, heldout_file, chunk, residency,
                                      graphs_per_layer, out, max_context, options, where)
        build_one_target(model_dir, dtype, plan_path, target, out, max_context, layers, where, options)


def build_one_target(model_dir, dtype, plan_path, target, out, max_context, layers, jobs, options) -> None:
    from npumoe.core.base.outputs import check_free_space
    from npumoe.core.compiler.artifacts import build
    from npumoe.core.planning.costmodel import footprint
    from npumoe.core.planning.plan import Plan
    from npumoe.models.loader import load

    model = load(model_dir, dtype=dtype)
    options = chosen_build_options(target, options)
    target_plan = Plan.load(plan_path)
    if not layers and target_plan.target == target:  # a partial build holds less; a mismatch is build's to refuse
        target_plan.check_model(model)
        check_free_space(out, footprint(model.spec, target_plan, max_context, options.get("precision", "fp16"))
                         .package_weight_bytes)
    manifest = build(model, target_plan, target, out, max_context=max_context,
                     layers=parse_layers(layers) if layers else None, jobs=jobs, **options)
    table = Table("graph", "kind", "inputs", "MB", "compile s", "files")
    for name, g in manifest["graphs"].items():
        table.add_row(name, g["kind"], " ".join(f"{k}{v}" for k, v in g["inputs"].items()), f"{g['bytes'] / 1e6:.1f}",
                      "cached" if g["cached"] else f"{g['seconds']:.1f}", ", ".join(g.get("files", [])))
    Console().print(table)
    cached = sum(g["cached"] for g in manifest["graphs"].values())
    total = sum((Path(out) / rel).stat().st_size for rel in manifest["files"])  # graphs may share a package
    click.echo(f"wrote {out}: {len(manifest['graphs'])} graphs ({cached} from the build cache), "
               f"{len(manifest['files'])} files, {total / 1e6:.1f} MB, manifest.json")
    if not isinstance(jobs, int):
        click.echo(f"{jobs.address}: {sum(jobs.nodes_used.values())} units lowered on {len(jobs.nodes_used)} nodes")


@contextmanager
def build_cache_at(directory: str | None):
    """``NPUMOE_BUILD_CACHE`` (what every build reads) set to ``directory`` for the duration, once it proved
    writable; nothing when it is None."""
    if directory is None:
        yield
        return
    if directory.startswith("file://") and urlsplit(directory).netloc in ("", "localhost"):
        directory = unquote(urlsplit(directory).path)  # fsspec's name for a local directory: the directory
    if "://" in directory:
        raise InputError(f"--cache takes a directory (or file:///path), not the URL {directory}: the cache renames "
                         "and links files, which object stores do not; give a directory on a file system every node "
                         "mounts (NFS).")
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as err:
        raise InputError(f"--cache {directory} is not a directory this process can write ({err.strerror or err}); "
                         "give one it can (with --cluster, one every node mounts).") from None
    before = os.environ.get("NPUMOE_BUILD_CACHE")
    os.environ["NPUMOE_BUILD_CACHE"] = str(Path(directory).resolve())
    try:
        yield
    finally:
        if before is None:
            del os.environ["NPUMOE_BUILD_CACHE"]
        else:
            os.environ["NPUMOE_BUILD_CACHE"] = before


@contextmanager
def lowering(jobs: int, cluster: str | None):
    """Where units are lowered: ``jobs`` processes here, or the Ray cluster at ``cluster``, connected meanwhile."""
    if cluster is None:
        yield jobs
        return
    from npumoe.backends.ray_cluster import connected

    with connected(cluster) as connection:
        yield connection


def build_every_target(model_dir, dtype, targets, text_files, heldout_file, chunk, residency, graphs_per_layer, out,
                       max_context, options, jobs) -> None:
    from npumoe.core.base.outputs import claim
    from npumoe.core.runtime.calibrate import default_calibration_texts
    from npumoe.core.tools.targets import TARGETS, build_targets
    from npumoe.models.loader import load

    names = [t.strip() for t in targets.split(",") if t.strip()]
    per_target = options_per_target(names, options)
    claim(out, TARGETS)
    texts = read_texts(text_files) if text_files else default_calibration_texts()
    texts, heldout = split_heldout(texts, read_texts((heldout_file,)) if heldout_file else None)
    model = load(model_dir, dtype=dtype)
    if model.tokenizer is None:
        raise InputError(f"{model.name} has no tokenizer, which --targets needs to calibrate and validate on text.")
    console = Console()
    manifest = build_targets(model, names, texts, model.tokenizer.encode(heldout), out, chunk=chunk,
                             max_context=max_context, residency=residency, options=per_target,
                             graphs_per_layer=graphs_per_layer, jobs=jobs,
                             report=lambda line: console.print(f"[dim]{line}[/dim]"))
    table = Table("target", "cosine", "top-1 %", "greedy", "ppl (ref)", "padded %", "spilled %", "NPU launches/chunk",
                  title=f"{model.name}: every target against the fp32 reference, {manifest['heldout_tokens']} "
                        "held-out tokens")
    for name, entry in manifest["targets"].items():
        v = entry["validation"]
        table.add_row(name, f"{v['cosine']:.5f}", f"{100 * v['top1_agreement']:.1f}",
                      f"{v['greedy_match']}/{v['greedy_tokens']}",
                      f"{v['perplexity']:.3f} ({v['reference_perplexity']:.3f})", f"{v['padded_pct']:.1f}",
                      f"{v['spilled_pct']:.1f}", f"{v['npu_launches_per_chunk']:.1f}")
    console.print(table)
    console.print("cosine: of each position's logits with the reference's, averaged; top-1: positions whose most "
                  "likely token agrees; greedy: new tokens equal to the reference's from the start; ppl: "
                  "perplexity on the held-out text; padded: of NPU expert slots; spilled: of routed slots, run on "
                  "the CPU past capacity.")
    click.echo(f"wrote {out}: {', '.join(manifest['targets'])}, manifest.json (run one with npumoe generate "
               f"--artifacts {out} --target {names[0]})")


def split_heldout(texts: dict[str, str], heldout: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """Calibration texts and the held-out text: the one given, else the last text, else a single text's
    last tenth — never text the calibration saw."""
    if heldout is not None:
        return texts, "\n".join(heldout.values())
    if len(texts) > 1:
        *kept, last = texts
        return {k: texts[k] for k in kept}, texts[last]
    (name, text), = texts.items()
    cut = len(text) * 9 // 10
    return {name: text[:cut]}, text[cut:]


def parse_layers(text: str) -> set[int]:
    """"0-3,7" → {0, 1, 2, 3, 7}."""
    layers: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise InputError(f"--layers takes layer numbers and ranges like 0-3,7, not {text!r}.") from None
    return layers
