"""Outputs and artifacts: nothing of the user's is lost, nothing outside an artifact is read.

Every written path is new, empty, or an earlier npumoe output of the same kind; anything else, and
any place that cannot be written, is refused in one line before work starts.
"""

import json
import os

import pytest
from cli_check import cli_error

import npumoe
from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.base.outputs import claimed, staged_directory, staging_prefix
from npumoe.core.compiler.artifacts import ARTIFACTS, MANIFEST, read_manifest
from npumoe.core.planning.plan import PLAN, plan
from npumoe.core.runtime.calibrate import calibrate


@pytest.fixture(scope="module")
def model():
    return npumoe.load()  # the shipped demo model


@pytest.fixture(scope="module")
def plan_path(model, tmp_path_factory):
    profile = calibrate(model, [list(b"def f(x):\n    return x * 2\n" * 6)], chunk=16)
    return str(plan(model, profile, target="htp", residency="npu").save(tmp_path_factory.mktemp("p") / "plan.json"))


def user_dir(path):
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    return path


def test_build_keeps_a_directory_of_the_users_files(plan_path, tmp_path, capsys):
    out = user_dir(tmp_path / "work")
    err = cli_error(capsys, "build", "--plan", plan_path, "--target", "htp", "--out", str(out))
    assert f"--out {out} holds files that are not an npumoe artifact directory" in err
    assert (out / "notes.txt").read_text() == "mine" and os.listdir(tmp_path) == ["work"]


def test_build_keeps_a_file(plan_path, tmp_path, capsys):
    out = tmp_path / "report.txt"
    out.write_text("mine")
    assert f"--out {out} is a file, and npumoe will not replace it with an npumoe artifact directory" in cli_error(
        capsys, "build", "--plan", plan_path, "--target", "htp", "--out", str(out))
    assert out.read_text() == "mine"


def test_outputs_of_another_kind_are_refused_before_work(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("npumoe.core.runtime.calibrate.calibrate", lambda *a, **k: pytest.fail("work started"))
    mine = tmp_path / "notes.json"
    mine.write_text("{}")
    assert "exists and is not a routing profile" in cli_error(capsys, "calibrate", "--out", str(mine))
    assert "is a directory; give a file path for a routing profile" in cli_error(
        capsys, "calibrate", "--out", str(tmp_path))
    assert f"--plot {mine} exists and is not an npumoe figure" in cli_error(
        capsys, "calibrate", "--out", str(tmp_path / "p.json"), "--plot", str(mine))
    assert "exists and is not an npumoe trace" in cli_error(capsys, "generate", "-n", "1", "--trace", str(mine))
    assert mine.read_text() == "{}"


def test_unwritable_outputs_are_refused_before_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("npumoe.core.runtime.calibrate.calibrate", lambda *a, **k: pytest.fail("work started"))
    (tmp_path / "f").write_text("")
    assert f"cannot be created: {tmp_path / 'f'} is a file, not a directory" in cli_error(
        capsys, "calibrate", "--out", str(tmp_path / "f" / "sub" / "p.json"))
    if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("/sys is writable here")
    assert "/sys/p.json cannot be written" in cli_error(capsys, "calibrate", "--out", "/sys/p.json")


def test_an_earlier_output_of_the_same_kind_is_replaced(plan_path, tmp_path):
    earlier = npumoe.Plan.load(plan_path)
    earlier.save(tmp_path / "plan.json")
    assert npumoe.Plan.load(earlier.save(tmp_path / "plan.json")).to_json() == earlier.to_json()
    (tmp_path / "profile.json").write_text(json.dumps({"kind": "npumoe.RoutingProfile"}))
    with pytest.raises(InputError, match="profile.json exists and is not a plan"):
        earlier.save(tmp_path / "profile.json")


def test_a_directory_is_swapped_in_whole_and_only_when_complete(tmp_path):
    out = tmp_path / "build"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"kind": "npumoe.Artifacts"}))
    (out / "old.bin").write_text("old")
    with pytest.raises(RuntimeError), claimed(out, ARTIFACTS), staged_directory(out) as staging:
        (staging / "half.bin").write_text("half")
        raise RuntimeError("killed mid-build")
    assert sorted(os.listdir(out)) == ["manifest.json", "old.bin"] and os.listdir(tmp_path) == ["build"]
    with claimed(out, ARTIFACTS), staged_directory(out) as staging:
        (staging / "new.bin").write_text("new")
    assert os.listdir(out) == ["new.bin"] and os.listdir(tmp_path) == ["build"]


def test_a_killed_runs_leftovers_are_removed_by_the_next_run(tmp_path):
    out = tmp_path / "plan.json"
    dead = tmp_path / f".plan.json.npumoe-{2 ** 22 + 7}-abc"  # above Linux's largest pid
    dead.mkdir()
    (tmp_path / f".plan.json.npumoe-{2 ** 22 + 7}-x.tmp").write_text("half")
    live = tmp_path / (staging_prefix(out) + "abc")
    live.mkdir()
    with claimed(out, PLAN):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


@pytest.fixture(params=[0o022, 0o077], ids=["umask-022", "umask-077"])
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def test_outputs_get_the_modes_a_plain_open_and_mkdir_give_under_the_users_umask(model, umask, tmp_path,
                                                                                  monkeypatch):
    """A profile, a plan and a build are created as the user's own files would be (tempfile's staging is private:
    0600 and 0700); a build's compiled files are shared with the build cache by hard links, so they are the same
    read-only."""
    from npumoe.backends.cpu.backend import CpuBackend
    from npumoe.core.compiler.artifacts import build
    from npumoe.core.ir.backend import Lowered

    def lower_to_a_file(self, graph, weights, out_dir):  # as a toolchain writes its artifact: with open()
        (out_dir / f"{graph.name}.bin").write_bytes(b"compiled")
        return Lowered("ir", (f"{graph.name}.bin",), {"graph": graph.name})

    monkeypatch.setattr(CpuBackend, "lower", lower_to_a_file)
    monkeypatch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "plain.txt").touch()
    (tmp_path / "plain").mkdir()
    file_mode, dir_mode = (os.stat(tmp_path / name).st_mode & 0o777 for name in ("plain.txt", "plain"))
    assert (file_mode, dir_mode) == (0o666 & ~umask, 0o777 & ~umask)
    profile = calibrate(model, [list(b"def f(x):\n    return x * 2\n" * 6)], chunk=16)
    cpu_plan = plan(model, profile, target="cpu", residency="npu")
    manifest = build(model, cpu_plan, "cpu", tmp_path / "build", max_context=32)
    mode = {path: os.stat(path).st_mode & 0o777 for path in (profile.save(tmp_path / "profile.json"),
                                                              cpu_plan.save(tmp_path / "plan.json"),
                                                              tmp_path / "build" / MANIFEST)}
    assert set(mode.values()) == {file_mode}, {str(p): oct(m) for p, m in mode.items()}
    assert os.stat(tmp_path / "build").st_mode & 0o777 == dir_mode
    compiled = [tmp_path / "build" / rel for rel in manifest["files"] if rel != MANIFEST]
    assert compiled and {os.stat(p).st_mode & 0o777 for p in compiled} == {file_mode & 0o555}


def fake_artifacts(path, files=None, graphs=None):
    path.mkdir()
    (path / MANIFEST).write_text(json.dumps({"kind": "npumoe.Artifacts", "files": files or {},
                                             "graphs": graphs or {}, "chunk": 16, "max_context": 64}))
    return path


@pytest.mark.parametrize("files, graphs", [
    ({"../../etc/passwd": "0" * 64}, None),
    (None, {"moe.0": {"kind": "experts", "context_model": "../../etc/passwd"}}),
    (None, {"moe.0": {"files": ["/etc/passwd"]}}),
])
def test_manifest_paths_outside_the_artifact_are_refused(tmp_path, capsys, files, graphs):
    path = fake_artifacts(tmp_path / "a", files, graphs)
    with pytest.raises(ArtifactError, match="lies outside"):
        read_manifest(path)
    assert "lies outside" in cli_error(capsys, "generate", "--target", "htp", "--artifacts", str(path))


def test_a_symlink_out_of_the_artifact_is_refused(tmp_path):
    path = fake_artifacts(tmp_path / "a", {"graphs/x.bin": "0" * 64})
    (path / "graphs").symlink_to("/etc")
    with pytest.raises(ArtifactError, match="'graphs/x.bin', which lies outside"):
        read_manifest(path)


def test_the_current_directory_and_the_root_are_never_replaced(tmp_path, capsys, monkeypatch):
    """`--out .` once had its staging renamed over the directory the user stood in (and failed after the work);
    `--out /` had no name to put a lock beside. Both are one line before any work."""
    from npumoe.models.loader import DEMO_DIR

    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for out in (".", ".."):
        assert cli_error(capsys, "quantize", "--model", str(DEMO_DIR), "--out", out) == (
            f"error: --out {out} holds the current directory; give a path inside it, such as ./out.")
    assert cli_error(capsys, "calibrate", "--out", "/") == (
        "error: --out / is the file system's root; give a path under it.")
    assert os.listdir(tmp_path) == ["here"] and os.listdir(tmp_path / "here") == []
