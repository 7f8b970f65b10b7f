"""Fuzzing the bad-input contract: whatever a user's files or arguments hold, npumoe ends with a typed
:class:`NpumoeError` (on the CLI: one ``error: …`` line, exit 2) or a correct result, never a traceback, a
signal, a hang or silent garbage (NaN/Inf logits, a wrong shape).

The hand-written cases in test_errors.py pin the messages of the mistakes we thought of; this file draws
the ones we did not: mutated config.json values, flipped and truncated safetensors bytes, mutated artifact
manifests, random CLI option values. Any exception that is not an ``NpumoeError`` is a failure: that is the
point. An input that found a real bug stays here as an explicit ``@example``.

CI runs a small, derandomized, database-free number of examples (the file takes about a minute on two
cores). A longer, randomized run: ``NPUMOE_FUZZ=long pytest tests/test_fuzz.py`` (profile "fuzz-long").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from hf_compare import build_checkpoint, transformers
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import npumoe
from npumoe.backends.cpu.backend import CpuBackend
from npumoe.cli import main
from npumoe.core.base.errors import NpumoeError
from npumoe.core.compiler.artifacts import MANIFEST, build, build_digest, load_executors
from npumoe.core.compiler.program import build_program

# -- profiles ---------------------------------------------------------------------------------------
settings.register_profile(
    "fuzz-ci", max_examples=1, derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("fuzz-long", settings.get_profile("fuzz-ci"), derandomize=False)
LONG = os.environ.get("NPUMOE_FUZZ") == "long"
PROFILE = settings.get_profile("fuzz-long" if LONG else "fuzz-ci")
LONG_FACTOR = 50  # a long run draws this many times each test's CI examples


def fuzz(ci_examples: int) -> settings:
    """Settings for one fuzz test: its CI budget (chosen so the file stays near a minute on 2 cores), or
    LONG_FACTOR times that, randomized, under NPUMOE_FUZZ=long. Not loaded globally, so the other test
    files keep hypothesis' defaults."""
    return settings(PROFILE, max_examples=ci_examples * (LONG_FACTOR if LONG else 1))


HANG_SECONDS = 60  # one example on the tiny model takes well under a second; this is a hang


@contextlib.contextmanager
def no_hang(seconds: int = HANG_SECONDS):
    """Turn a hang into a failure of the example that caused it (hypothesis then shrinks it), rather than
    a CI job killed after an hour with no input named."""
    def hung(*_):
        raise AssertionError(f"no answer after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


IDS = [1, 2, 3, 4, 5, 6, 7]
VOCAB = 50


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint, built once: every example mutates a cheap copy of it."""
    path = tmp_path_factory.mktemp("fuzz") / "tiny"
    build_checkpoint(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    ), path)
    return path


@pytest.fixture(scope="module", autouse=True)
def private_fingerprint_cache(tmp_path_factory):
    """Weight fingerprints of the thousands of mutated copies go to a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NPUMOE_CACHE_DIR", str(tmp_path_factory.mktemp("fingerprints")))
        yield


@pytest.fixture(scope="module")
def reference(tiny):
    """The unmutated checkpoint's logits: what a run that succeeds on harmless edits must give."""
    return npumoe.Engine(npumoe.load(tiny), chunk=4, max_context=16).forward(IDS)


_copies = iter(range(1 << 62))


def fresh_copy(src: Path, root: Path, keep: tuple[str, ...] = ()) -> Path:
    """A new directory with every file of ``src`` symlinked (cheap) except those named in ``keep``, which
    are real copies an example may then overwrite. A new name per example: hypothesis reuses one tmp_path."""
    dst = root / f"c{next(_copies)}"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in keep:
            (dst / f.name).write_bytes(f.read_bytes())
        else:
            (dst / f.name).symlink_to(f.resolve())
    return dst


def expect_typed_error_or_finite(run, shape: tuple[int, ...], reference: np.ndarray | None = None):
    """The contract: ``run()`` raises an NpumoeError with a one-line message, or returns finite logits of
    ``shape`` (equal to ``reference`` when given: an edit that changes nothing must change no number).
    Anything else propagates and fails the example."""
    try:
        with no_hang():
            logits = run()
    except NpumoeError as err:
        message = str(err)
        assert message and "\n" not in message and "Traceback" not in message, repr(message)
        return err
    assert logits.shape == shape, logits.shape
    assert np.isfinite(logits).all(), "non-finite logits returned instead of NumericError"
    if reference is not None:
        np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=1e-4)
    return None


def load_and_forward(path: Path):
    """load + a short forward on the CPU reference path: the least a user does with a checkpoint."""
    return npumoe.Engine(npumoe.load(path), chunk=4, max_context=16).forward(IDS)


# -- 1. config.json -----------------------------------------------------------------------------------
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.sampled_from([0, -1, 2 ** 31, 2 ** 63, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1.0, 32.0, -0.0, 1e-30]),
    st.text(max_size=8), st.sampled_from(["32", "qwen3_moe", "silu", "", "yarn"]),
)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
MISSING = object()


@st.composite
def config_edits(draw, keys: list[str]) -> dict:
    """1-3 edits of real keys of the config (a wrong type, range or a removal), sometimes an unknown key."""
    names = draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True))
    edits = {k: draw(st.just(MISSING) | JSON_VALUES) for k in names}
    if draw(st.booleans()):
        edits[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    return edits


def mutated_config_dir(tiny: Path, root: Path, edits: dict) -> Path:
    path = fresh_copy(tiny, root, keep=("config.json",))
    cfg = json.loads((tiny / "config.json").read_text())
    for key, value in edits.items():
        if value is MISSING:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


CONFIG_KEYS = sorted(json.loads(json.dumps(transformers.Qwen3MoeConfig().to_dict())).keys())


@fuzz(30)
@given(edits=config_edits(CONFIG_KEYS))
@example(edits={"max_position_embeddings": None})  # a TypeError in the rope tables' int() (long run)
@example(edits={"rms_norm_eps": None})  # a TypeError in the qk-norm's float() (long run)
def test_fuzzed_config_is_refused_or_runs(tiny, tmp_path, edits):
    path = mutated_config_dir(tiny, tmp_path, edits)
    expect_typed_error_or_finite(lambda: load_and_forward(path), (len(IDS), VOCAB))


# -- 2. safetensors bytes -------------------------------------------------------------------------------
def header_end(path: Path) -> int:
    """Where a safetensors file's data starts: 8 bytes of header length, then the JSON header."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@st.composite
def byte_damage(draw, size: int, header: int) -> tuple[str, list[tuple[int, int]] | int]:
    """A truncation at a random offset, or 1-4 bytes xor-ed in the header (mostly) or the data."""
    if draw(st.booleans()):
        return "truncate", draw(st.integers(0, size - 1))
    region = draw(st.sampled_from([(0, header), (0, header), (header, size)]))
    flips = draw(st.lists(st.tuples(st.integers(*region).filter(lambda i: i < size), st.integers(1, 255)),
                          min_size=1, max_size=4))
    return "flip", flips


def damaged(data: bytes, damage) -> bytes:
    kind, what = damage
    if kind == "truncate":
        return data[:what]
    out = bytearray(data)
    for at, mask in what:
        out[at] ^= mask
    return bytes(out)


@pytest.fixture(scope="module")
def weights_info(tiny):
    """The real file's size and header end, so the damage is drawn where the file is."""
    weights = tiny / "model.safetensors"
    return weights.stat().st_size, header_end(weights)


@fuzz(30)
@given(data=st.data())
@example(data=None)  # the undamaged file itself: the contract's "correct result" branch, checked exactly
def test_damaged_safetensors_is_refused_or_runs(tiny, tmp_path, reference, weights_info, data):
    size, header = weights_info
    damage = ("flip", []) if data is None else data.draw(byte_damage(size, header), label="damage")
    path = fresh_copy(tiny, tmp_path, keep=("model.safetensors",))
    (path / "model.safetensors").write_bytes(damaged((tiny / "model.safetensors").read_bytes(), damage))
    data_only = damage[0] == "flip" and all(at >= header for at, _ in damage[1])
    # a flipped data byte may give other finite numbers; the header, bytes 0..header, must never be
    # misread silently: either refused or (a harmless byte such as JSON whitespace) the same numbers
    expect_typed_error_or_finite(lambda: load_and_forward(path), (len(IDS), VOCAB),
                                 None if data_only else reference)


# -- 3. artifact manifests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifacts(tiny, tmp_path_factory):
    """CPU artifacts of the tiny model with every expert 'on the NPU', so the manifest has graphs to name."""
    model = npumoe.load(tiny)
    plan = npumoe.plan(model, npumoe.calibrate(model, [list(range(VOCAB))], chunk=4), target="cpu",
                       residency="npu")
    out = tmp_path_factory.mktemp("artifacts") / "build"
    build(model, plan, "cpu", out, max_context=16, progress=False)
    return out


def json_paths(value, prefix=()) -> list[tuple]:
    """Every key path inside a JSON value (dict keys and list indices), for picking a place to mutate."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [p for k, v in items for p in [(*prefix, k), *json_paths(v, (*prefix, k))]]


def set_path(value, path: tuple, new):
    """``value`` with the item at ``path`` replaced by ``new`` (removed when ``new`` is MISSING)."""
    *parents, last = path
    target = value
    for k in parents:
        target = target[k]
    if new is MISSING:
        del target[last]
    else:
        target[last] = new
    return value


ESCAPING_PATHS = st.sampled_from(["../x", "../../etc/passwd", "/etc/passwd", "/", "..", "a/../../b", "", "."])


# an edit: (where, new value); where is a key path, or an int picking one of the manifest's key paths (so the
# strategy needs no manifest at import time, and found inputs can be written as explicit key paths)
MANIFEST_EDITS = st.lists(st.tuples(st.integers(0, 1 << 16), st.just(MISSING) | ESCAPING_PATHS | JSON_VALUES),
                          min_size=1, max_size=3)


def edited_manifest(manifest: dict, edits) -> dict:
    """A deep copy of ``manifest`` with the edits applied in order; an edit whose place an earlier one
    removed or replaced is skipped."""
    edited = json.loads(json.dumps(manifest))
    for where, new in edits:
        paths = json_paths(edited)
        if isinstance(where, int):
            if not paths:
                continue
            where = paths[where % len(paths)]
        with contextlib.suppress(KeyError, IndexError, TypeError):
            set_path(edited, where, new)
    return edited


@pytest.fixture(scope="module")
def built(artifacts, tiny):
    """The manifest, the model and its NPU graphs, read once."""
    model = npumoe.load(tiny)
    manifest = json.loads((artifacts / MANIFEST).read_text())
    program = build_program(model.spec, chunk=manifest["chunk"], max_context=manifest["max_context"],
                            plan=npumoe.Plan.from_json(manifest["plan"]))
    return manifest, model, [g for g in program.graphs.values() if g.placement == "npu"]


def run_artifacts(model, graphs, path: Path):
    """What a user's artifacts go through: the engine reads the manifest (and its plan) to run, and the
    backend's loader verifies every file and loads each graph."""
    load_executors(CpuBackend(), path, graphs, model.weights, model)
    return npumoe.Engine(model, artifacts=path).forward(IDS)


CAPACITY = ("plan", "layers", "1", "groups", 0, "shapes")  # layer 1's first group's compiled shapes


@fuzz(30)
@given(edits=MANIFEST_EDITS, resign=st.booleans())
@example(edits=[(("chunk",), MISSING)], resign=False)  # was a KeyError in the engine
@example(edits=[((*CAPACITY, 0, 0), 2 ** 63)], resign=True)  # an OverflowError in the runtime (hypothesis 6.170)
@example(edits=[((*CAPACITY, 1), 0)], resign=True)  # a capacity for a shape: TypeError reading the plan (6.170)
@example(edits=[(("graphs", "L1.experts.g0.p2", "files"), None)], resign=False)  # TypeError loading it (long run)
@example(edits=[(("graphs", "L0.experts.g0.d"), "\x00")], resign=False)  # ValueError checking it as a path (long run)
def test_fuzzed_manifest_is_refused_or_runs(artifacts, built, reference, tmp_path, edits, resign):
    """``resign``: the edited plan's and context's sha256 recorded too, as a buggy writer would, so the checks
    behind the hash are fuzzed as well. The artifacts record the plan and chunk they run with: a run of a
    manifest that is not refused gives their numbers; a re-signed plan may be another valid one (spill
    becoming drop), so there only the contract's shape and finiteness hold."""
    manifest, model, graphs = built
    out = fresh_copy(artifacts, tmp_path, keep=(MANIFEST,))
    edited = edited_manifest(manifest, edits)
    if resign and {"plan", "max_context"} <= edited.keys():
        edited["build_sha256"] = build_digest(edited)
    (out / MANIFEST).write_text(json.dumps(edited))
    expect_typed_error_or_finite(lambda: run_artifacts(model, graphs, out), (len(IDS), VOCAB),
                                 None if resign else reference)


@fuzz(10)
@given(data=st.data())
def test_damaged_artifact_files_are_refused_or_run(artifacts, built, reference, tmp_path, data):
    manifest, model, graphs = built
    name = data.draw(st.sampled_from(sorted(p.name for p in artifacts.iterdir() if p.is_file())), label="file")
    original = (artifacts / name).read_bytes()
    damage = data.draw(byte_damage(len(original), len(original)), label="damage")
    out = fresh_copy(artifacts, tmp_path, keep=(name,))
    (out / name).write_bytes(damaged(original, damage))
    expect_typed_error_or_finite(lambda: run_artifacts(model, graphs, out), (len(IDS), VOCAB), reference)


# -- 4. the CLI -----------------------------------------------------------------------------------------
def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    """``npumoe *argv`` in-process: (exit code, stderr). Success returns normally (code 0)."""
    capsys.readouterr()
    try:
        with no_hang():
            main(argv)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    return code, capsys.readouterr().err.strip()


def assert_cli_contract(capsys, argv: list[str]) -> int:
    """Exit 0, or exit 2 with one ``error: …`` line (click's usage errors print a usage line first: their
    last line is the error) and no traceback. Exit 1 or a raised exception fails the example."""
    code, err = run_cli(capsys, argv)
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = err.splitlines()
        assert "Traceback" not in err, err
        assert lines and (lines[-1].startswith("error: ") or lines[-1].startswith("Error: ")), err
        if lines[-1].startswith("error: "):  # npumoe's own errors: exactly one line
            assert len(lines) == 1, err
    return code


# argv comes from a shell: any text but NUL (no C string holds it) and lone surrogates (not decodable)
ARG_TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=12)
NUMBERS = st.one_of(st.integers(-3, 40).map(str), st.sampled_from(["0", "-1", "1e3", "2.5", "10000000000", "",
                                                                   "99999999999999999999", "nan", "0x10"]), ARG_TEXT)
IDS_TEXT = st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=6).map(lambda xs: ",".join(map(str, xs))),
                     ARG_TEXT, st.sampled_from(["1,,2", " ", "1 2\t3", "1;2", "99999999999999999999", "1e2"]))


@st.composite
def options(draw, names: dict) -> list[str]:
    """A random subset of ``names`` (option → value strategy), as argv."""
    return [a for name, values in names.items() if draw(st.booleans()) for a in (name, draw(values))]


@fuzz(20)
@given(data=st.data())
def test_fuzzed_generate_arguments(tiny, capsys, data):
    argv = ["generate", "--model", str(tiny), "--ids", data.draw(IDS_TEXT, label="ids"), *data.draw(options({
        "-n": NUMBERS, "--chunk": NUMBERS, "--max-context": NUMBERS}), label="options")]
    assert_cli_contract(capsys, argv)


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    """A short text: calibrate's default (all of pydoc's topics) would take seconds an example."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("def f(x):\n    return x * 2\n")
    return path


@pytest.fixture(scope="module")
def profile_path(tiny, tmp_path_factory):
    model = npumoe.load(tiny)
    return npumoe.calibrate(model, [list(range(VOCAB))], chunk=4).save(
        tmp_path_factory.mktemp("profile") / "profile.json")


def fresh_path(root: Path, suffix: str) -> str:
    return str(root / f"out{next(_copies)}{suffix}")


@fuzz(10)
@given(data=st.data())
@example(data=["plan", None, ["--graphs-per-layer", "10000000000"]])  # a shape per chunk at most, not 10^10
@example(data=["plan", "\r", []])  # the path's line break split the one-line error in two
def test_fuzzed_calibrate_and_plan_arguments(tiny, calibration_text, profile_path, tmp_path, capsys, data):
    """calibrate's --chunk; plan's numeric options; the --text/--profile path a random string sometimes.
    An explicit example passes ``data`` as [command, path or None for the good one, options]."""
    draw = data.draw if not isinstance(data, list) else lambda _strategy, label, found=iter(data): next(found)
    if draw(st.booleans(), label="calibrate") in (True, "calibrate"):
        text = draw(st.just(str(calibration_text)) | ARG_TEXT, label="text")
        text = str(calibration_text) if text is None else text
        # the demo model: it has a tokenizer, so --chunk is reached
        argv = ["calibrate", "--text", text, "--out", fresh_path(tmp_path, ".json"),
                *draw(options({"--chunk": NUMBERS}), label="options")]
    else:
        profile = draw(st.just(str(profile_path)) | ARG_TEXT, label="profile")
        profile = str(profile_path) if profile is None else profile
        argv = ["plan", "--model", str(tiny), "--profile", profile, "--target", "cpu",
                "--out", fresh_path(tmp_path, ".json"),
                *draw(options({"--graphs-per-layer": NUMBERS, "--max-overflow": NUMBERS}), label="options")]
    assert_cli_contract(capsys, argv)


@fuzz(20)
@given(path=st.one_of(ARG_TEXT, st.sampled_from(["/", "/dev/null", "/proc/self", "/etc/passwd", ".", "..", "~",
                                                 "/nonexistent/x", "tests"])))
def test_fuzzed_inspect_paths(capsys, path):
    assert_cli_contract(capsys, ["inspect", path])
