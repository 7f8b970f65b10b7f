"""The Qualcomm Hexagon NPU (HTP) backend: QNN context binaries through ONNX Runtime's QNN EP.

``build`` lowers each NPU graph to ONNX (:mod:`npumoe.backends.onnx_export`), optionally to QDQ w8a16 /
w4a16 with activation ranges captured from the reference program (:mod:`.calibration`,
:mod:`.quantize`), and compiles it on QNN's HTP backend with CPU fallback disabled into an
EPContext model: ``graphs/<name>_ctx.onnx`` plus its QNN context binary, the files a
Snapdragon phone or laptop loads. The plain ``graphs/<name>.onnx`` stays beside it (AI Hub
compiles from it). A node the HTP rejects fails the build, named (:mod:`.diagnose`).

``via="executorch"`` lowers the same graphs with ExecuTorch's QNN partitioner to ``.pte``
instead (:mod:`.pte`), reaching QNN 2.51 through a small shim (:mod:`.shim`).

``load`` opens the EPContext model (or ``.pte``) on the HTP (:mod:`.executor`); on x86_64
QNN's HTP backend runs it in its software model of the NPU, so the whole pipeline runs here.
``--trace`` merges host spans with the HTP's per-graph profile (:mod:`.trace`); AI Hub jobs
are in :mod:`.hub`.
"""

from __future__ import annotations

from pathlib import Path

from npumoe.backends.base import BackendBase
from npumoe.backends.qualcomm_htp.caps import HTP_CAPS
from npumoe.backends.qualcomm_htp.qnn import DEFAULT_SOC, soc_info
from npumoe.backends.qualcomm_htp.quantize import SCHEMES, checked_precision, precision_for
from npumoe.core.base.errors import ArtifactError, InputError
from npumoe.core.base.io import atomic_write_bytes
from npumoe.core.ir.backend import DeviceMemoryFull, Lowered

VIAS = ("onnx", "executorch")
GRAPH_DIR = "graphs"
FORMAT = "qnn_epcontext"
PTE_FORMAT = "pte"


class HtpBackend(BackendBase):
    name = "htp"
    caps = HTP_CAPS

    def __init__(self, via: str = "onnx", precision: str = "fp16", soc: str | int = DEFAULT_SOC,
                 profile_dir: str | Path | None = None, calibration_text: str | None = None, keep_onnx: bool = False,
                 **other):
        """``keep_onnx`` also saves each graph's ONNX model (fp32 weights: larger than its fp16 context binary,
        and needed only to compile again elsewhere, e.g. ``npumoe hub compile``)."""
        if other:
            raise InputError(f"--{next(iter(other)).replace('_', '-')} does not apply to the HTP; its options are "
                             "--via, --precision, --soc and --keep-onnx.")
        self.keep_onnx = bool(keep_onnx)
        if via not in VIAS:
            raise InputError(f"--via {via!r} is not one of {', '.join(VIAS)} for the HTP.")
        precision = checked_precision(precision)
        if via == "executorch":
            from npumoe.backends.qualcomm_htp.pte import PRECISIONS

            if precision not in PRECISIONS:
                raise InputError(f"--via executorch takes --precision {' or '.join(PRECISIONS)} (QnnQuantizer "
                                 f"16a8w), not {precision!r}.")
        self.soc_name, self.htp_arch = soc_info(soc)
        self.via, self.precision, self.soc = via, precision, str(soc)
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        self.calibration_text = calibration_text
        self.samples: dict[str, list] = {}
        self.calibration: dict | None = None

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"

    # -- build -----------------------------------------------------------------------------------
    def calibrate(self, model, plan, max_context: int, names: list[str]) -> None:
        """Record the NPU graphs' inputs on the reference program (QDQ precisions only)."""
        if self.fp16:
            return
        from npumoe.backends.qualcomm_htp.calibration import DECODE_STEPS, capture

        self.samples = capture(model, plan, max_context, names, self.calibration_text)
        self.calibration = {"text": "given" if self.calibration_text else "pydoc_data.topics",
                            "decode_steps": DECODE_STEPS,
                            "samples_per_graph": {n: len(s) for n, s in sorted(self.samples.items())}}

    def cache_salt(self, graph):
        """A QDQ graph's scales come from its calibration feeds: their bytes are part of what it is."""
        if self.fp16:
            return None
        import hashlib

        import numpy as np

        h = hashlib.blake2b(digest_size=16)
        for feed in self.samples.get(graph.name, []):
            for name, value in sorted(feed.items()):
                h.update(name.encode() + np.ascontiguousarray(value).tobytes())
        return h.hexdigest()

    def lower(self, graph, weights, out_dir: Path) -> dict:
        if not self.fp16 and graph.name not in self.samples:
            raise InputError(f"--precision {self.precision} needs calibration feeds for {graph.name}; build through "
                             "npumoe build (or npumoe.core.compiler.artifacts.build), which captures them.")
        return self._lower_pte(graph, weights, Path(out_dir)) if self.via == "executorch" else \
            self._lower_onnx(graph, weights, Path(out_dir))

    def _lower_pte(self, graph, weights, out_dir: Path) -> dict:
        from npumoe.backends.qualcomm_htp.pte import save_pte
        from npumoe.backends.qualcomm_htp.qnn import chipset

        rel = Path(GRAPH_DIR) / f"{graph.name}.pte"
        save_pte(graph, weights, out_dir / rel, self.precision, chipset(self.soc), self.samples.get(graph.name))
        return Lowered(PTE_FORMAT, (str(rel),), {"pte": str(rel), "soc": self.soc, "precision": self.precision,
                                                 "pte_bytes": (out_dir / rel).stat().st_size})

    def _lower_onnx(self, graph, weights, out_dir: Path) -> dict:
        from npumoe.backends.onnx_export import UnsupportedOp, to_onnx
        from npumoe.backends.qualcomm_htp.diagnose import rejection_error
        from npumoe.backends.qualcomm_htp.qnn import session

        try:
            model = to_onnx(graph, weights)
        except UnsupportedOp as err:
            raise InputError(f"graph {graph.name} has IR op {err.op.op!r} ({err.op.outputs[0]}), which the HTP backend "
                             "cannot lower; place this graph on the CPU in the plan.") from None
        precision = precision_for(graph.kind, self.precision)
        if not self.fp16:
            from npumoe.backends.qualcomm_htp.quantize import quantize

            model = quantize(model, self.samples[graph.name], precision, weights)
        data = model.SerializeToString()
        rel = Path(GRAPH_DIR) / f"{graph.name}.onnx" if self.keep_onnx else None
        ctx = Path(GRAPH_DIR) / f"{graph.name}_ctx.onnx"
        (out_dir / GRAPH_DIR).mkdir(parents=True, exist_ok=True)
        if rel is not None:
            atomic_write_bytes(out_dir / rel, data)
        try:
            session(data, self.soc, self.fp16, context_path=out_dir / ctx)
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own Fail/RuntimeException types
            raise rejection_error(graph, data, self.soc, self.fp16, err) from None
        binaries = sorted(p.name for p in (out_dir / GRAPH_DIR).glob(f"{graph.name}_ctx*") if p.suffix != ".onnx")
        return Lowered(FORMAT, (*([str(rel)] if rel else []), str(ctx),
                                *(str(Path(GRAPH_DIR) / b) for b in binaries)), {
            "onnx": None if rel is None else str(rel),
            "context_model": str(ctx),
            "context_binary_bytes": sum((out_dir / GRAPH_DIR / b).stat().st_size for b in binaries),
            "soc": self.soc,
            "precision": precision,
            "onnx_inputs": [i.name for i in model.graph.input],
        })

    # -- run -------------------------------------------------------------------------------------
    def load(self, artifact: dict, out_dir: Path, graph, weights):
        from npumoe.backends.qualcomm_htp.executor import HtpExecutor
        from npumoe.backends.qualcomm_htp.qnn import session

        if artifact.format == PTE_FORMAT:
            from npumoe.backends.qualcomm_htp.pte import PteExecutor

            return PteExecutor(Path(out_dir) / artifact.info["pte"], graph)
        if artifact.format != FORMAT:
            raise ArtifactError(f"{out_dir} was not built for the HTP; build it with npumoe build --target htp.")
        csv = None
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            csv = self.profile_dir / f"{graph.name}.csv"
            csv.unlink(missing_ok=True)
        try:
            sess = session(Path(out_dir) / artifact.info["context_model"], artifact.info["soc"],
                           artifact.info["precision"] == "fp16", profile_csv=csv)
        except Exception as err:  # noqa: BLE001 - onnxruntime raises its own Fail/RuntimeException types
            if "MEM_ALLOC" in str(err):  # QNN_COMMON_ERROR_MEM_ALLOC: the HTP holds no more contexts
                raise DeviceMemoryFull("QNN_COMMON_ERROR_MEM_ALLOC") from None
            raise
        return HtpExecutor(sess, graph, csv)

    def describe(self) -> dict:
        from npumoe.backends.onnx_export import OPSET
        from npumoe.backends.qualcomm_htp.executor import MASK_FLOOR
        from npumoe.backends.qualcomm_htp.qnn import versions

        if self.via == "executorch":
            scheme = {"fp16": {"weights": "fp16", "activations": "fp16 (QNN HTP fp16 compile spec)"},
                      "w8a16": {"quantizer": "ExecuTorch QnnQuantizer QuantDtype.use_16a8w (MinMax calibration)"}}
            from importlib.metadata import version

            toolchain = {"executorch": version("executorch"), "partitioner": "QnnPartitioner",
                         "qnn_shim": "npumoe shim: ExecuTorch's QNN 2.37 device config rewritten for the 2.51 HTP"}
        else:
            scheme = {"fp16": {"weights": "fp32 in the ONNX graph, fp16 on the HTP",
                               "activations": "fp16 (enable_htp_fp16_precision)"}, **SCHEMES}
            toolchain = {"onnx_opset": OPSET}
        return {"name": self.name, "via": self.via, "precision": self.precision, "quantization": scheme[self.precision],
                "soc_model": self.soc, "soc": self.soc_name, "htp_arch": self.htp_arch,
                "qnn_version": versions()["qnn"], "onnxruntime_qnn": versions()["onnxruntime_qnn"], **toolchain,
                "mask_floor": MASK_FLOOR, "calibration": self.calibration,
                "keep_onnx": self.keep_onnx}  # in the build cache's key: a unit built without its ONNX has none


__all__ = ["HTP_CAPS", "HtpBackend"]
