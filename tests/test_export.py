"""npumoe export on the demo model: the program, run by the native runner in a process of its own (a C++ binary, so
neither npumoe nor torch can be in it), gives the greedy tokens and the logits of npumoe's own engine under the same
plan; the runner refuses bad input with one line; the export command names a missing toolchain."""

import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from native_run import npumoe_run, skip_without_compiler

import npumoe
from npumoe.cli import main
from npumoe.models.demo import corpus

pytest.importorskip("executorch.exir", reason="npumoe export needs the executorch wheel")

from npumoe.core.tools import native_runner  # noqa: E402 (needs executorch)
from npumoe.core.tools.export import export  # noqa: E402

CHUNK, CONTEXT, NEW = 32, 160, 32
# Measured here: max |Δlogit| 1.4e-5 at logits up to 15 (relative 1e-6) over 32 steps, the program's XNNPACK
# products summing in another order than torch's; ten times that is the bound.
RELATIVE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def demo():
    return npumoe.load(dtype="float32")


@pytest.fixture(scope="module")
def plan(demo):
    """An htp plan (capacities aligned to 8, three shapes a group): its static buffers and spill path both run."""
    profile = npumoe.calibrate(demo, [t[:1024] for t in corpus.calibration_texts(2)], chunk=CHUNK, window=512)
    return npumoe.plan(demo, profile, target="htp", residency="npu")


@pytest.fixture(scope="module")
def exported(demo, plan, tmp_path_factory):
    skip_without_compiler()
    out = tmp_path_factory.mktemp("export") / "demo-cpu"
    return out, export(demo, "cpu", out, plan=plan, max_context=CONTEXT)


@pytest.fixture(scope="module")
def prompt():
    """Held-out text over two chunks and part of a third: padding rows and chunk-to-chunk cache reads both run."""
    return corpus.heldout_texts(1)[0][:75]



def test_the_runner_gives_the_engines_tokens_and_logits(demo, plan, exported, prompt):
    out, _ = exported
    ids = demo.tokenizer.encode(prompt)
    engine = npumoe.Engine(demo, plan=plan, max_context=CONTEXT)
    new, logits = engine.generate(np.asarray(ids), max_new_tokens=NEW, return_logits=True)
    m = engine.metrics
    assert m["npu_launches"] > 0 and m["spilled"] > 0  # the plan's static buffers and its spill both ran
    done = npumoe_run(out, "--tokens", ",".join(map(str, ids)), "--max-new-tokens", str(NEW), "--json", "--logits")
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["tokens"] == ids + new.tolist()
    assert np.abs(np.asarray(result["logits"]) - logits).max() <= RELATIVE_TOLERANCE * np.abs(logits).max()
    assert result["prefill_tok_s"] > 0 and result["decode_tok_s"] > 0


def test_the_experts_pair_by_pair_path_and_the_head_are_read_in_place(demo, exported):
    """A decode token's routed experts, and a prompt's spilled pairs, go through ``npumoe::swiglu_experts`` over the
    stacked fp32 matrices (no gathered copies): one call a MoE layer in each method; the LM head through
    ``npumoe::f32_linear_rows`` (no packed copy in XNNPACK's memory)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    out, _ = exported
    for plan in deserialize_pte_binary((out / "model.pte").read_bytes()).program.execution_plan:
        if plan.name in ("prefill", "decode"):
            names = [op.name for op in plan.operators]
            calls = [names[i.instr_args.op_index] for chain in plan.chains for i in chain.instructions
                     if hasattr(i.instr_args, "op_index")]
            assert calls.count("npumoe::swiglu_experts") == demo.spec.num_layers, plan.name
            assert calls.count("npumoe::f32_linear_rows") == 1, plan.name  # the LM head, read in place


def test_the_programs_padding_and_spill_counts_are_the_engines(demo, plan, exported, prompt):
    """On held-out text, the prefill's static buffers pad and spill what the engine's do for the same plan, chunk by
    chunk (the runtime's semantics moved into the program, not changed): the counts the program returns beside its
    logits. The program prefills chunk by chunk; the engine's default buffers a long prompt's tokens per expert
    across chunks (fewer, fuller launches), which the program does not do."""
    ids = demo.tokenizer.encode(prompt)
    engine = npumoe.Engine(demo, plan=plan, max_context=CONTEXT, buffering=False)
    engine.generate(np.asarray(ids), max_new_tokens=1)  # the prefill alone (decode's graphs pad in their own way)
    m = engine.metrics
    done = npumoe_run(exported[0], "--tokens", ",".join(map(str, ids)), "--max-new-tokens", "1", "--json")
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["prefill_moe"] == {"padded": m["padded"], "spilled": m["spilled"],
                                                      "dropped": m["dropped"]}
    assert m["padded"] > 0 and m["spilled"] > 0


def test_a_prompt_goes_through_the_tokenizer_beside_the_program(demo, plan, exported, prompt):
    out, _ = exported
    new = npumoe.Engine(demo, plan=plan, max_context=CONTEXT).generate(np.asarray(demo.tokenizer.encode(prompt)), 8)
    done = npumoe_run(out, "--prompt", prompt, "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == bytes(new.tolist()) + b"\n"  # the byte tokenizer: token id = byte


def test_the_runner_needs_neither_python_nor_torch(exported):
    needed = subprocess.run(["readelf", "-d", str(exported[0] / "npumoe-run")], capture_output=True, text=True,
                            check=True).stdout
    libraries = [line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line]
    assert "libexecutorch.so" in libraries
    assert not [lib for lib in libraries if lib.startswith(("libpython", "libtorch", "libc10"))]


def test_the_directory_holds_the_program_its_runner_tokenizer_and_manifest(demo, exported):
    out, manifest = exported
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.pte", "npumoe-run",
                                                    "npumoe_tokenizer.json"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["npumoe_version"] == native_runner.npumoe_version() and manifest["get_vocab_size"] == 256
    assert manifest["get_max_context_len"] == CONTEXT and manifest["npumoe_chunk"] == CHUNK
    assert set(manifest["methods"]) == {"prefill", "decode"} and manifest["fingerprint"] == demo.fingerprint
    weight_bytes = sum(demo.weights[name].numel() * 4 for name in demo.weights)  # fp32, each once
    assert weight_bytes < manifest["files"]["model.pte"] < 1.1 * weight_bytes  # both methods, one copy


def patched(program: bytes, old: str, new: str) -> bytes:
    """The program with its one flatbuffer string ``old`` (length-prefixed, NUL-ended) replaced by ``new``."""
    assert len(old) == len(new)
    find = struct.pack("<I", len(old)) + old.encode() + b"\0"
    assert program.count(find) == 1
    return program.replace(find, struct.pack("<I", len(new)) + new.encode() + b"\0")


@pytest.fixture
def copy(exported, tmp_path):
    """A copy of the exported directory to damage."""
    return shutil.copytree(exported[0], tmp_path / "copy")


def other_version(version: str) -> str:
    return version[:-1] + ("1" if version[-1] != "1" else "2")


@pytest.mark.parametrize("damage, args, says", [
    ("version", ["--tokens", "1,2"], "was exported by npumoe"),
    ("target", ["--tokens", "1,2"], "was exported for target htp"),
    ("not a program", ["--tokens", "1,2"], "is not an ExecuTorch program"),
    ("no program", ["--tokens", "1,2"], "cannot read the program"),
    ("marker of another kind", ["--prompt", "hi"], "is not npumoe's tokenizer marker"),
    ("hugging face tokenizer", ["--prompt", "hi"], "is a Hugging Face tokenizer, which this runner does not read"),
    (None, ["--tokens", ",".join(["1"] * CONTEXT)], "exceeds the program's context of 160"),
    (None, ["--tokens", "1,256"], "token id 256 is outside the program's vocabulary [0, 256)"),
    (None, ["--tokens", "1,x"], "--tokens takes integers"),
    (None, ["--tokens", "1", "--max-new-tokens", "0"], "--max-new-tokens takes a whole number"),
])
def test_bad_input_is_one_line_and_exit_2(copy, damage, args, says):
    pte = copy / "model.pte"
    if damage == "version":
        pte.write_bytes(patched(pte.read_bytes(), native_runner.npumoe_version(),
                                other_version(native_runner.npumoe_version())))
    elif damage == "target":
        pte.write_bytes(patched(pte.read_bytes(), "cpu", "htp"))
    elif damage == "not a program":
        pte.write_bytes(b"not a program" * 100)
    elif damage == "no program":
        pte.unlink()
    elif damage == "marker of another kind":
        (copy / "npumoe_tokenizer.json").write_text('{"kind": "words"}')
    elif damage == "hugging face tokenizer":
        (copy / "npumoe_tokenizer.json").rename(copy / "tokenizer.json")
    done = npumoe_run(copy, *args)
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_export_without_the_executorch_wheel_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "executorch", None)  # importlib.util.find_spec then finds nothing
    with pytest.raises(SystemExit) as stop:
        main(["export", "--target", "cpu", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: npumoe export needs the executorch wheel; install it with "
                                       "pip install executorch==1.5.1.\n")


def test_export_without_a_compiler_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(SystemExit) as stop:
        main(["export", "--target", "cpu", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "install g++ or clang++, or point CXX" in err


def test_decoding_on_an_npu_of_the_cpu_target_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["export", "--target", "cpu", "--decode-on", "npu", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "--decode-on npu needs an NPU target" in err
    assert not (tmp_path / "out").exists()
