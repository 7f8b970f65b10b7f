"""Faults while writing: a kill at any point, two writers, a full disk, a killed parent of build workers.

Whatever happens, an output is absent, the earlier complete one, or the new complete one, and never half-written
and accepted by the next command (docs/reliability.md).
"""

import errno
import itertools
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_check import cli_error

import npumoe
from npumoe.cli import main
from npumoe.core.base.errors import InputError, NpumoeError
from npumoe.core.base.io import atomic_write_text
from npumoe.core.base.outputs import OutputKind, claimed, json_kind, lock_file, remove_stale_staging, staged_directory

OUTPUT = OutputKind("a test output", directory=True, recognise=lambda path: json_kind("test")(path / "manifest.json"))
FILE_CHANGES = ("rename", "replace", "unlink", "rmdir")  # what a write does to the file system, step by step


def write_output(out, version: int, files: int = 3) -> None:
    """An output of ``files`` files, its manifest written last, as every npumoe directory output is."""
    with claimed(out, OUTPUT), staged_directory(out) as staging:
        for i in range(files):
            (staging / f"part{i}.bin").write_bytes(bytes([version]) * 1000)
        atomic_write_text(staging / "manifest.json", json.dumps({"kind": "test", "version": version}))


def contents(out) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())} if out.exists() else {}


def killed_at(step: int, write) -> bool:
    """Run ``write()`` in a forked child that dies at its ``step``-th file-system change (os._exit: no handler,
    no cleanup, as SIGKILL); whether it was killed before finishing."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        count = [0]

        def dying(real):
            def change(*args, **kwargs):
                count[0] += 1
                if count[0] == step:
                    os._exit(9)
                return real(*args, **kwargs)
            return change

        for name in FILE_CHANGES:
            setattr(os, name, dying(getattr(os, name)))
        try:
            write()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 9


def test_a_kill_at_any_step_of_a_replace_leaves_the_old_or_the_new_output_whole(tmp_path):
    """Killed at each rename and unlink of replacing an earlier output, the next run finds the earlier output or
    the new one, complete (never nothing, never a mix), and its own write then lands whole with no leftovers."""
    write_output(tmp_path / "reference", 2)
    new = contents(tmp_path / "reference")
    (tmp_path / "work").mkdir()
    out = tmp_path / "work" / "out"
    write_output(out, 1)
    old = contents(out)
    seen = []
    for step in itertools.count(1):
        if not killed_at(step, lambda: write_output(out, 2)):
            break
        remove_stale_staging(out)  # what the next run's claim does first
        found = contents(out)
        assert found in (old, new), f"killed at step {step}, the next run finds {sorted(found) or 'no output'}"
        seen.append("old" if found == old else "new")
        write_output(out, 1)
        assert os.listdir(out.parent) == ["out"] and contents(out) == old
    assert "old" in seen[1:] and "new" in seen, f"the kills never fell between the swap's renames: {seen}"
    assert contents(out) == new


HOLDER = ("import sys\nfrom pathlib import Path\nfrom npumoe.core.base.outputs import OutputKind, claim\n"
          "claim(sys.argv[1], OutputKind('anything', sys.argv[2] == 'dir', lambda p: True))\n"
          "print('held', flush=True)\nsys.stdin.read()\n")


@contextmanager
def held(out, directory: bool):
    """Another process holding ``out``'s claim for the length of the block."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), "dir" if directory else "file"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


@pytest.fixture(scope="module")
def demo():
    return npumoe.load()


@pytest.fixture(scope="module")
def demo_plan(demo):
    from npumoe.core.runtime.calibrate import calibrate

    profile = calibrate(demo, [list(b"def f(x):\n    return x * 2\n" * 6)], chunk=16)
    return profile, npumoe.plan(demo, profile, target="cpu", residency="npu")


def writers(demo, demo_plan):
    """Every kind of writer over core/base/outputs, with whether it writes a directory."""
    from npumoe.core.compiler.artifacts import build
    from npumoe.core.tools.export import export
    from npumoe.models.checkpoints.quantize import quantize_checkpoint
    from npumoe.models.loader import DEMO_DIR

    profile, cpu_plan = demo_plan
    return {"profile": (False, profile.save), "plan": (False, cpu_plan.save),
            "build": (True, lambda out: build(demo, cpu_plan, "cpu", out, max_context=32)),
            "export": (True, lambda out: export(demo, "cpu", out)),
            "quantize": (True, lambda out: quantize_checkpoint(DEMO_DIR, out, bits=4, group=32))}


@pytest.mark.parametrize("writer", ["profile", "plan", "build", "export", "quantize"])
def test_a_second_writer_is_refused_naming_the_first(writer, demo, demo_plan, tmp_path):
    directory, write = writers(demo, demo_plan)[writer]
    out = tmp_path / "out"
    with held(out, directory) as pid, pytest.raises(InputError) as refused:
        write(out)
    assert str(refused.value) == (f"--out {out} is being written by another npumoe process (pid {pid}); wait for it "
                                  "to finish, or choose another path.")
    assert os.listdir(tmp_path) == []  # nothing written, and the holder's lock gone with it


def test_two_npumoe_processes_on_one_out(demo_plan, tmp_path):
    """A real second `npumoe calibrate` on the --out a first one is writing exits 2 in one line naming the first;
    the first, killed, leaves no claim behind: the next writer gets the path."""
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 4)
    out = tmp_path / "profile.json"
    argv = [str(Path(sys.executable).with_name("npumoe")), "calibrate", "--text", str(text), "--chunk", "16",
            "--out", str(out)]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while lock_file(out).is_file() is False or lock_file(out).read_text().strip() != str(first.pid):
            assert first.poll() is None and time.monotonic() < deadline, "the first writer never claimed --out"
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)  # mid-write, for as long as the second one runs
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and second.stderr == (
            f"error: --out {out} is being written by another npumoe process (pid {first.pid}); wait for it to "
            "finish, or choose another path.\n")
    finally:
        first.kill()
        first.wait()
    assert not out.exists()
    demo_plan[0].save(out)
    assert sorted(os.listdir(tmp_path)) == ["profile.json", "text.txt"]


def test_quantize_refuses_a_disk_without_room_before_any_work(tmp_path, capsys, monkeypatch):
    """The room quantize asks for is what its weights then take in the file (the header aside), and a file system
    with less is refused in one line naming both, before a tensor is read."""
    from npumoe.models.checkpoints import lut as checkpoint
    from npumoe.models.loader import DEMO_DIR

    main(["quantize", "--model", str(DEMO_DIR), "--bits", "4", "--out", str(tmp_path / "q")])
    with open(tmp_path / "q" / checkpoint.WEIGHTS_FILE, "rb") as f:
        data = os.fstat(f.fileno()).st_size - 8 - int.from_bytes(f.read(8), "little")
    written = []
    monkeypatch.setattr("npumoe.models.checkpoints.quantize.check_free_space", lambda out, need: written.append(need))
    monkeypatch.setattr("npumoe.models.checkpoints.quantize._write_weights", lambda *a: pytest.fail("work started"))
    with pytest.raises(BaseException, match="work started"):
        main(["quantize", "--model", str(DEMO_DIR), "--bits", "4", "--out", str(tmp_path / "q2")])
    assert written == [data]
    monkeypatch.undo()
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=data // 2))
    monkeypatch.setattr("npumoe.models.checkpoints.quantize._write_weights", lambda *a: pytest.fail("work started"))
    assert cli_error(capsys, "quantize", "--model", str(DEMO_DIR), "--bits", "4", "--out", str(tmp_path / "q2")) == (
        f"error: --out {tmp_path / 'q2'} needs about {data / 1e6:,.1f} MB but {tmp_path} has {data // 2 / 1e6:,.1f} "
        "MB free; free some space or choose another location.")
    assert sorted(os.listdir(tmp_path)) == ["q"]


def test_a_disk_filling_up_mid_write_is_one_line_and_keeps_the_earlier_output(tmp_path, capsys, monkeypatch):
    from npumoe.core.ir.tensorfile import SafetensorsWriter
    from npumoe.models.loader import DEMO_DIR

    out = tmp_path / "q"
    main(["quantize", "--model", str(DEMO_DIR), "--bits", "4", "--out", str(out)])
    before = contents(out)
    add, added = SafetensorsWriter.add, []

    def add_until_full(self, name, tensor, **options):
        if len(added) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        added.append(name)
        add(self, name, tensor, **options)

    monkeypatch.setattr(SafetensorsWriter, "add", add_until_full)
    err = cli_error(capsys, "quantize", "--model", str(DEMO_DIR), "--bits", "3", "--out", str(out))
    assert err.startswith(f"error: the disk filled up while writing {out} (No space left on device;") and err.endswith(
        "free some space and run again."), err
    assert os.listdir(tmp_path) == ["q"] and contents(out) == before


@pytest.fixture
def tiny_disk():
    """A real 1 MiB tmpfs, where the kernel itself says no space left (outside pytest's temporary directories,
    which another session may rename while it is mounted)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mount = Path(tempfile.mkdtemp(prefix="npumoe-tiny-disk-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        mount.rmdir()
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: detached even if something holds it
    mount.rmdir()


def test_a_real_full_disk(tiny_disk, demo_plan, capsys):
    """On a 1 MiB tmpfs: quantize (a 2.1 MB output) is refused before it starts; once the disk is full, a plan's
    write fails in one line and leaves nothing of itself."""
    from npumoe.models.loader import DEMO_DIR

    err = cli_error(capsys, "quantize", "--model", str(DEMO_DIR), "--bits", "4", "--out", str(tiny_disk / "q"))
    assert re.search(r"needs about [\d.]+ MB but .* has 1\.\d MB free", err), err
    with open(tiny_disk / "filler", "wb") as filler:
        with pytest.raises(OSError) as full:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(InputError, match=f"the disk filled up while writing {tiny_disk / 'plan.json'}"):
        demo_plan[1].save(tiny_disk / "plan.json")
    assert os.listdir(tiny_disk) == ["filler"]


def process_states() -> dict[int, tuple[int, str]]:
    """Every process's parent and state (R, S, Z, ...) from /proc."""
    states = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        states[int(stat.parent.name)] = int(fields[1]), fields[0]
    return states


def living(pids) -> set[int]:
    states = process_states()
    return {pid for pid in pids if pid in states and states[pid][1] not in "ZX"}


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from /proc")
def test_a_killed_build_takes_its_workers_with_it(demo, demo_plan, tmp_path):
    pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'npumoe[htp]')")
    plan_path = npumoe.plan(demo, demo_plan[0], target="htp", residency="npu").save(tmp_path / "plan.json")
    build = subprocess.Popen([str(Path(sys.executable).with_name("npumoe")), "build", "--plan", str(plan_path),
                              "--target", "htp", "--out", str(tmp_path / "build"), "--jobs", "2"],
                             env={**os.environ, "NPUMOE_BUILD_CACHE": str(tmp_path / "cache")},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(workers := {pid for pid, (parent, _) in process_states().items() if parent == build.pid}) < 2:
            assert build.poll() is None and time.monotonic() < deadline, "the build never started its 2 workers"
            time.sleep(0.01)
    finally:
        build.kill()
        build.wait()
    deadline = time.monotonic() + 5
    while living(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = living(workers)
    for pid in survivors:  # not left behind when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"workers {sorted(survivors)} outlived their killed build"


# --------------------------------------------------------------------------- the kill fuzz
# A command killed (SIGKILL) at some point of its run leaves its --out absent, the earlier complete output, or the
# new complete one; a next command accepts only those. CI kills at fixed points; NPUMOE_FUZZ=long at random ones
# (NPUMOE_FUZZ_SEED replays a run: the seed is printed on failure).

LONG = os.environ.get("NPUMOE_FUZZ") == "long"
SEED = int(os.environ.get("NPUMOE_FUZZ_SEED", random.randrange(2**32)))
LONG_KILLS = 8  # per command under NPUMOE_FUZZ=long
EVENTS = ("started", "claimed", "writing")  # what a kill's delay counts from


def kill_points(ci: list[tuple[str, float]], command: str) -> list[tuple[str, float]]:
    if not LONG:
        return ci
    rng = random.Random(f"{SEED}-{command}")
    return [(rng.choice(EVENTS), round(rng.uniform(0, 2), 3)) for _ in range(LONG_KILLS)]


def reached(event: str, out: Path, pid: int) -> bool:
    if event == "claimed":
        try:
            return lock_file(out).read_text().strip() == str(pid)
        except OSError:
            return False
    if event == "writing":
        return any(p.name.startswith(f".{out.name}.npumoe-{pid}-") for p in out.parent.iterdir())
    return True


def run_killed(argv: list[str], out: Path, event: str, delay: float) -> bool:
    """Run ``npumoe *argv`` and SIGKILL it ``delay`` s after ``event``; whether it finished before."""
    proc = subprocess.Popen([str(Path(sys.executable).with_name("npumoe")), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not reached(event, out, proc.pid):
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline, f"npumoe {argv[0]} never reached {event}"
            time.sleep(0.002)
        time.sleep(delay)
    finally:
        proc.kill()
        finished = proc.wait() == 0
    return finished


def next_command_sees(out: Path, accept) -> str | None:
    """What a next command finds at ``out``: None when it is absent or refused, else the identity ``accept``
    names (reading it as that command would)."""
    if not os.path.lexists(out):
        return None
    try:
        return accept(out)
    except NpumoeError:
        return None


def check_kills(out: Path, kind: OutputKind, argv: list[str], points, earlier, accept, new: str) -> None:
    """Kill ``npumoe *argv --out out`` at each of ``points`` over the output ``earlier()`` puts there, and hold the
    property: whatever a next command accepts is the earlier output or the new one, whole; the next writer then
    finds one of those and no leftovers."""
    old = accept(earlier(out))
    for event, delay in points:
        where = f"npumoe {' '.join(argv)} killed {delay} s after {event} (NPUMOE_FUZZ_SEED={SEED})"
        if os.path.lexists(out):
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        earlier(out)
        run_killed([*argv, "--out", str(out)], out, event, delay)
        assert next_command_sees(out, accept) in (None, old, new), f"{where}: a half-written output was accepted"
        with claimed(out, kind):  # the next writer tidies up first
            assert accept(out) in (old, new), f"{where}: the next writer finds no whole output"
        assert os.listdir(out.parent) == [out.name], f"{where}: left {os.listdir(out.parent)}"


def test_killed_quantize(tmp_path):
    from npumoe.models.checkpoints.quantize import QUANTIZED_CHECKPOINT
    from npumoe.models.loader import DEMO_DIR

    argv = ["quantize", "--model", str(DEMO_DIR), "--bits", "3"]
    main([*argv, "--out", str(tmp_path / "new")])
    main([*argv[:-1], "4", "--out", str(tmp_path / "old")])
    refs = {"old": contents(tmp_path / "old"), "new": contents(tmp_path / "new")}

    def accept(out):  # what was written is what loads, and it is one of the two
        npumoe.load(out)
        return next(name for name, ref in refs.items() if contents(out) == ref)

    (tmp_path / "work").mkdir()
    check_kills(tmp_path / "work" / "q", QUANTIZED_CHECKPOINT, argv,
                kill_points([("writing", 0.0), ("writing", 0.3)], "quantize"),
                lambda out: shutil.copytree(tmp_path / "old", out), accept, "new")


def test_killed_calibrate(demo, tmp_path):
    from npumoe.core.planning.profile import PROFILE, RoutingProfile

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 12)
    argv = ["calibrate", "--text", str(text), "--chunk", "64"]
    main([*argv, "--out", str(tmp_path / "new.json")])
    (tmp_path / "old.json").write_text(json.dumps({**json.loads((tmp_path / "new.json").read_text()),
                                                   "sources": ["an earlier calibration"]}))
    refs = {"old": (tmp_path / "old.json").read_bytes(), "new": (tmp_path / "new.json").read_bytes()}

    def accept(out):
        RoutingProfile.load(out).check_model(demo)
        return next(name for name, ref in refs.items() if out.read_bytes() == ref)

    (tmp_path / "work").mkdir()
    check_kills(tmp_path / "work" / "p.json", PROFILE, argv, kill_points([("claimed", 0.5)], "calibrate"),
                lambda out: shutil.copyfile(tmp_path / "old.json", out), accept, "new")


def test_killed_build(demo, demo_plan, tmp_path):
    pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'npumoe[htp]')")
    from npumoe.core.compiler.artifacts import ARTIFACTS, build, read_manifest

    htp = npumoe.plan(demo, demo_plan[0], target="htp", residency="npu")
    build(demo, htp, "htp", tmp_path / "old", max_context=32)
    argv = ["build", "--plan", str(htp.save(tmp_path / "plan.json")), "--target", "htp", "--max-context", "64"]

    def accept(out):  # every file as its manifest says, and which build it is
        return {32: "old", 64: "new"}[read_manifest(out)["max_context"]]

    (tmp_path / "work").mkdir()
    check_kills(tmp_path / "work" / "build", ARTIFACTS, argv, kill_points([("writing", 0.0)], "build"),
                lambda out: shutil.copytree(tmp_path / "old", out), accept, "new")


# --------------------------------------------------------------------------- resource bounds
MEMORY_LIMIT = 4 << 30  # the bytes a refused input may drive the process to: a failure here stays harmless
REFUSALS = """import sys
import npumoe
for arg in sys.argv[1:]:
    try:
        npumoe.Engine(npumoe.load(), plan=npumoe.Plan.load(arg)) if arg.endswith(".json") else npumoe.load(arg)
        print("accepted")
    except npumoe.NpumoeError as err:
        print(err)
"""


def refusals(*args) -> list[str]:
    """What loading each model directory (or running each plan on the demo) says, in one process held to
    MEMORY_LIMIT of address space and a minute: an input that drives memory up fails this way instead of taking
    the machine."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))  # noqa: E731
    done = subprocess.run([sys.executable, "-c", REFUSALS, *map(str, args)], capture_output=True, text=True,
                          timeout=60, preexec_fn=limit)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def test_sizes_beyond_the_weights_or_this_machine_are_refused_before_any_allocation(demo_plan, tmp_path):
    """A config of 10^8 layers or experts built a spec of gigabytes (a MemoryError after 50 s) before the weights
    were found missing, and an edited plan's alignment once drove a process to 24 GB: each is one line now, the
    config's against the bytes of weights beside it, the plan's against its bounds and this machine's memory."""
    from npumoe.models.loader import DEMO_DIR

    inputs, expected = [], []
    for key in ("num_hidden_layers", "num_local_experts", "vocab_size"):
        model = shutil.copytree(DEMO_DIR, tmp_path / key)
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, key: 10**8}))
        inputs.append(model)
        expected.append(f"{model / 'config.json'}'s {key} is 100000000, more than the 13.5 MB of weights beside it")
    plan = json.loads(demo_plan[1].save(tmp_path / "plan.json").read_text())
    for field, value in (("alignment", 2**40), ("chunk", 10**9)):
        (tmp_path / f"{field}.json").write_text(json.dumps({**plan, field: value}))
        inputs.append(tmp_path / f"{field}.json")
        expected.append(f"{field} {value}")
    for said, part in zip(refusals(*inputs), expected, strict=True):
        assert part in said, said


def test_build_refuses_a_disk_without_room_for_its_plan(demo, demo_plan, tmp_path, capsys, monkeypatch):
    """build's room is the plan's compiled weights as npumoe plan reports them (costmodel.footprint)."""
    pytest.importorskip("onnxruntime_qnn", reason="onnxruntime-qnn is not installed (pip install 'npumoe[htp]')")
    from npumoe.core.planning.costmodel import footprint

    htp = npumoe.plan(demo, demo_plan[0], target="htp", residency="npu")
    need = footprint(demo.spec, htp, 512).package_weight_bytes
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=int(need) - 1))
    monkeypatch.setattr("npumoe.core.compiler.artifacts.build", lambda *a, **k: pytest.fail("work started"))
    assert cli_error(capsys, "build", "--plan", str(htp.save(tmp_path / "plan.json")), "--target", "htp", "--out",
                     str(tmp_path / "build")) == (
        f"error: --out {tmp_path / 'build'} needs about {need / 1e6:,.1f} MB but {tmp_path} has "
        f"{(int(need) - 1) / 1e6:,.1f} MB free; free some space or choose another location.")
