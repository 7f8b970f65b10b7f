"""`npumoe hub compile|profile`: the built ONNX graphs as Qualcomm AI Hub jobs on real Snapdragon devices.

``compile`` submits every graph's plain ONNX model (``graphs/<name>.onnx``) with
``--target_runtime qnn_context_binary``, waits, and downloads each compiled context binary
into ``OUT/hub/``; ``profile`` runs those compiled models on the device and downloads the
profiles. Job ids and the new files' sha256 are recorded in ``manifest.json``.

AI Hub needs the user's token (``qai-hub configure --api_token …``, stored in
``~/.qai_hub/client.ini``); without one nothing is submitted.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from npumoe.core.base.errors import ArtifactError, BackendUnavailableError
from npumoe.core.base.io import atomic_write_text, sha256_file
from npumoe.core.base.outputs import claimed
from npumoe.core.base.progress import task

COMPILE_OPTIONS = "--target_runtime qnn_context_binary --compute_unit npu"
HUB_DIR = "hub"
DEFAULT_DEVICE = "Samsung Galaxy S24 (Family)"
CONFIG = Path.home() / ".qai_hub" / "client.ini"


def hub_client():
    """qai_hub, configured with a token; a typed error saying how otherwise."""
    try:
        import qai_hub
    except ImportError as err:
        raise BackendUnavailableError(
            f"npumoe hub needs the qai-hub client ({err}); install it with pip install qai-hub 'protobuf<=6.31.1'."
        ) from err
    from qai_hub.client import UserError

    try:
        qai_hub.hub._global_client.config  # noqa: B018 - reads client.ini (or raises), touches no network
    except UserError as err:
        raise BackendUnavailableError(
            "no Qualcomm AI Hub token is configured; get one at https://app.aihub.qualcomm.com/account/ and run "
            f"qai-hub configure --api_token YOUR_TOKEN (it is stored in {CONFIG}), then retry."
        ) from err
    return qai_hub


def compile_requests(manifest: dict, out_dir: Path) -> list[tuple[str, Path]]:
    """(graph, ONNX file) for every graph of a verified HTP build: what ``compile`` submits."""
    if manifest["target"] != "htp":
        raise ArtifactError(f"{out_dir} was built for {manifest['target']!r}; AI Hub jobs take an HTP build "
                            "(npumoe build --target htp).")
    if any(not entry.get("onnx") for entry in manifest["graphs"].values()):
        raise ArtifactError(f"{out_dir} keeps only the compiled context binaries; AI Hub compiles from each graph's "
                            "ONNX model: rebuild with npumoe build --target htp --keep-onnx.")
    return [(name, out_dir / entry["onnx"]) for name, entry in sorted(manifest["graphs"].items())]


def _record(out_dir: Path, manifest: dict, key: str, jobs: dict[str, str], device: str, files: list[Path]) -> None:
    from npumoe.core.compiler.artifacts import MANIFEST

    manifest.setdefault("hub", {})[key] = {"device": device, "jobs": jobs}
    manifest["files"] |= {str(p.relative_to(out_dir)): sha256_file(p) for p in files}
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def _wait(jobs: dict, what: str) -> None:
    with task(f"AI Hub {what}", len(jobs), "jobs") as step:
        for name, job in jobs.items():
            step.describe(f"AI Hub {what}: {name}")
            status = job.wait()
            if not status.success:
                raise BackendUnavailableError(f"AI Hub {what} job {job.job_id} for {name} failed: {status.message}.")
            step.advance()


def hub_compile(out_dir: Path, device: str) -> dict[str, str]:
    from npumoe.core.compiler.artifacts import ARTIFACTS, read_manifest

    hub = hub_client()
    with claimed(out_dir, ARTIFACTS, "--artifacts"):  # one writer: no build swaps it meanwhile
        manifest = read_manifest(out_dir)
        target = hub.Device(device)
        jobs = {name: hub.submit_compile_job(model=str(path), device=target, options=COMPILE_OPTIONS,
                                             name=f"npumoe {name}")
                for name, path in compile_requests(manifest, out_dir)}
        _wait(jobs, "compile")
        files = []
        for name, job in jobs.items():
            files.append(Path(job.download_target_model(str(out_dir / HUB_DIR / f"{name}.bin"))))
        ids = {name: job.job_id for name, job in jobs.items()}
        _record(out_dir, manifest, "compile", ids, device, files)
        return ids


def hub_profile(out_dir: Path, device: str) -> dict[str, str]:
    from npumoe.core.compiler.artifacts import ARTIFACTS, read_manifest

    hub = hub_client()
    with claimed(out_dir, ARTIFACTS, "--artifacts"):  # one writer: no build swaps it meanwhile
        manifest = read_manifest(out_dir)
        compiled = manifest.get("hub", {}).get("compile", {}).get("jobs")
        if not compiled:
            raise ArtifactError(f"{out_dir} has no AI Hub compile jobs; "
                                f"run npumoe hub compile --artifacts {out_dir} first.")
        target = hub.Device(device)
        jobs = {name: hub.submit_profile_job(model=hub.get_job(job_id).get_target_model(), device=target,
                                             name=f"npumoe {name}") for name, job_id in compiled.items()}
        _wait(jobs, "profile")
        files = []
        for name, job in jobs.items():
            path = out_dir / HUB_DIR / f"{name}.profile.json"
            atomic_write_text(path, json.dumps(job.download_profile(), indent=1, sort_keys=True))
            files.append(path)
        ids = {name: job.job_id for name, job in jobs.items()}
        _record(out_dir, manifest, "profile", ids, device, files)
        return ids


@click.command("hub")
@click.argument("action", type=click.Choice(["compile", "profile"]))
@click.option("--artifacts", required=True, type=click.Path(), help="An HTP artifact directory from npumoe build.")
@click.option("--device", default=DEFAULT_DEVICE, show_default=True, help="AI Hub device name.")
def hub_command(action, artifacts, device):
    """Compile (or profile) the built HTP graphs on Qualcomm AI Hub devices; needs your AI Hub token.

    Example: npumoe hub compile --artifacts build/htp --device "Samsung Galaxy S24 (Family)"
    """
    from npumoe.core.compiler.artifacts import MANIFEST

    run = hub_compile if action == "compile" else hub_profile
    ids = run(Path(artifacts), device)
    click.echo(f"{action}: {len(ids)} AI Hub jobs on {device}, recorded in {Path(artifacts) / MANIFEST}")
