"""``npumoe export``: a model, with or without its plan, as one ExecuTorch program and a native runner beside it.

    OUT/model.pte          the whole model (:mod:`npumoe.core.tools.whole_model`): methods ``prefill`` and ``decode``
                           over one KV cache they share, each weight stored once, and constant methods that name what
                           the runner checks (npumoe version and target, vocabulary, context, chunk, EOS ids)
    OUT/npumoe-run         the native runner (:mod:`npumoe.core.tools.native_runner`)
    OUT/<tokenizer file>   the model's own, copied (npumoe_tokenizer.json or tokenizer.json)
    OUT/manifest.json      versions, fingerprints, shapes, methods and what runs them, file sizes

The target's plugin record (:class:`~npumoe.core.ir.backend.ProgramTarget`) says which ExecuTorch partitioners hand
its device its part of the program and which backend libraries the runner links; nothing here names a target.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx.traceback import preserve_node_meta

from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.core.base.outputs import OutputKind, claimed, json_kind, staged_directory
from npumoe.core.compiler.interpreter import OP_IMPLS
from npumoe.core.compiler.program import build_program
from npumoe.core.ir.backend import ProgramTarget, RunnerSetup, plugin, plugin_object, plugins
from npumoe.core.ir.rope import short_context
from npumoe.core.planning.placement import CPU, decode_placement
from npumoe.core.runtime.engine import DEFAULT_CHUNK, DEFAULT_MAX_CONTEXT
from npumoe.core.tools import native_runner
from npumoe.core.tools.whole_model import Method, WholeModel

KIND = "npumoe.Export"
DECODE_ON = ("npu", "cpu")
MANIFEST, PROGRAM, RUNNER = "manifest.json", "model.pte", "npumoe-run"
TOKENIZER_FILES = ("npumoe_tokenizer.json", "tokenizer.json")  # what models/tokenizer.py reads, in its order
EXPORT = OutputKind("an exported program (npumoe export)", directory=True,
                    recognise=lambda path: json_kind(KIND)(path / MANIFEST))


def program_target(target: str) -> ProgramTarget:
    """``target``'s export record, or why it has none."""
    record = plugin(target).program
    if record is None:
        able = ", ".join(name for name, p in plugins().items() if p.program is not None)
        raise InputError(f"target {target} cannot be exported as one program yet; targets that can: {able}.")
    return record


def context_length(spec, max_context: int | None) -> int:
    """The KV cache length: as asked, else the engine's default, never past a longrope model's short context (beyond
    it every cached key would need re-rotating)."""
    limit = min(filter(None, (short_context(ls.attention.rope) for ls in spec.layers)), default=None)
    length = max_context or min(spec.max_position, DEFAULT_MAX_CONTEXT)
    if limit is not None and length > limit:
        if max_context:
            raise InputError(f"--max-context {max_context} passes this model's longrope short context of {limit}; "
                             f"give at most {limit}.")
        length = limit
    return length


def export(model, target: str, out: str | Path, plan=None, chunk: int | None = None, max_context: int | None = None,
           decode_on: str | None = None, report: Callable[[str], None] = lambda line: None) -> dict:
    """Write ``out`` (see the module docstring) and return its manifest; ``chunk`` is the plan's where there is one.
    ``decode_on="cpu"`` lowers the decode method for the CPU target (disaggregated: the device prefills, the CPU
    decodes, as decode is bound by weight bytes and launch cost); None or "npu", for ``target`` as prefill."""
    with claimed(out, EXPORT) as out:
        record = program_target(target)
        if decode_on not in (None, *DECODE_ON):
            raise InputError(f"--decode-on takes {' or '.join(DECODE_ON)}, not {decode_on!r}.")
        if decode_on == "npu" and target == CPU:
            raise InputError("--decode-on npu needs an NPU target; target cpu decodes on the CPU (leave --decode-on "
                             "out).")
        if target == CPU:
            placement = {"on": CPU}
        elif decode_on is None:
            chosen = decode_placement(model.spec, target, plan)
            decode_on, placement = chosen.on, chosen.to_json()
            report(chosen.reason())
        else:
            placement = {"on": decode_on, "chosen_by": "--decode-on"}
        decoder = program_target(CPU) if decode_on == "cpu" else record
        devices = {"prefill": record.device, "decode": decoder.device}
        if getattr(model.weights, "packed", None) and target != CPU:
            raise InputError(f"{model.name} holds quantised (packed) matrices, which only a program for target cpu "
                             "runs (its experts through npumoe's LUT kernels); export for --target cpu, or export "
                             "the unquantised checkpoint.")
        if plan is not None:
            plan.check_model(model)
            if plan.overflow != "spill":
                raise InputError(f"this plan's overflow policy is {plan.overflow}, but an exported program computes "
                                 "every routed pair (spill); make the plan with npumoe plan --overflow spill.")
            chunk = plan.chunk
        setup = plugin_object(plugin(target), record.runner_setup)() if record.runner_setup else RunnerSetup()
        libraries = tuple(dict.fromkeys((*record.libraries, *decoder.libraries)))
        # first: a missing compiler is found in seconds
        runner = native_runner.runner(target, libraries, setup, record.elsewhere or "")
        program = build_program(model.spec, chunk=chunk or DEFAULT_CHUNK, max_context=context_length(model.spec,
                                                                                                      max_context),
                                plan=plan)
        tokenizer = next((model.path / name for name in TOKENIZER_FILES if (model.path / name).is_file()), None)
        constants = program_metadata(model, program, target)
        manifest = {"kind": KIND, **constants, "model": model.name,
                    "fingerprint": model.fingerprint, "weights": model.weights_fingerprint(),
                    "plan": None if plan is None else {"target": plan.target, "method": plan.method,
                                                       "overflow": plan.overflow},
                    "methods": methods(program, devices), "decode_placement": placement,
                    "tokenizer": tokenizer and tokenizer.name,
                    "runner": RUNNER}
        report(f"exporting {model.name}: {model.spec.num_layers} layers, chunk {program.chunk}, context "
               f"{program.max_context}, {'plan for ' + plan.target if plan else 'no plan'}")
        start = time.perf_counter()
        impls = plugin_object(plugin(target), record.op_impls) if record.op_impls else OP_IMPLS
        lowerings = {"prefill": plugin_object(plugin(target), record.lower),
                     "decode": plugin_object(plugin(CPU if decode_on == "cpu" else target), decoder.lower)}
        module = WholeModel(program, model.weights, impls, expert_dtype=getattr(torch, record.expert_dtype),
                            in_place=target == CPU)  # (custom ops: no NPU partition takes them)
        data = lower(module.eval(), lowerings, constants)
        if record.check:
            plugin_object(plugin(target), record.check)(data)
        manifest["export_seconds"] = round(time.perf_counter() - start, 1)
        with staged_directory(out) as staging:
            (staging / PROGRAM).write_bytes(data)
            shutil.copy2(runner, staging / RUNNER)
            if tokenizer is not None:
                shutil.copy2(tokenizer, staging / tokenizer.name)
            manifest["files"] = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest


def program_metadata(model, program, target: str) -> dict:
    """What the program says of itself in constant methods (the runner reads them) and the manifest repeats. The
    ``get_*`` names are those ExecuTorch's LLM runner reads."""
    spec, bos = model.spec, model.config.get("bos_token_id")
    return {"npumoe_version": native_runner.npumoe_version(), "npumoe_target": target, "npumoe_chunk": program.chunk,
            "get_vocab_size": spec.vocab_size, "get_max_context_len": program.max_context,
            "get_eos_ids": list(spec.eos_token_ids), **({"get_bos_id": bos} if isinstance(bos, int) else {})}


def methods(program, devices: dict[str, str]) -> dict:
    """The program's methods as the manifest lists them: inputs and outputs (int64 ids and positions in, fp32
    logits out) and what runs each."""
    logits = {"logits": [1, program.spec.vocab_size]}
    return {"prefill": {"inputs": {"tokens": [program.chunk], "start": [1], "valid": [1]},
                        "outputs": {**logits, "moe_padded_spilled": [2]},
                        "device": devices["prefill"]},
            "decode": {"inputs": {"token": [1], "start": [1]}, "outputs": logits, "device": devices["decode"]}}


def lower(module: WholeModel, lowerings: dict[str, Callable], metadata: dict) -> bytes:
    """The module's two methods through torch.export and each method's target lowering into one program's bytes:
    mutable buffers shared by name across the methods (the KV cache), constants stored once."""
    try:
        from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig
        from executorch.exir.passes import MemoryPlanningPass
    except ImportError as err:
        raise BackendUnavailableError(f"npumoe export needs executorch ({err}); install it with "
                                      f"{native_runner.INSTALL_EXECUTORCH}.") from err
    position = torch.zeros(1, dtype=torch.int64)
    examples = {"prefill": (torch.zeros(module.chunk, dtype=torch.int64), position, position + 1),
                "decode": (torch.zeros(1, dtype=torch.int64), position)}
    with torch.no_grad(), warnings.catch_warnings():
        # torch's and ExecuTorch's notices to their own developers, and one about the cache's initial state, which
        # is not stored: the runtime's planned arenas start zeroed, and attention weighs every unwritten slot zero
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        with preserve_node_meta():  # keeps the expert products' annotation (whole_model.EXPERT_REGION) on the nodes
            exported = {name: torch.export.export(Method(module, name), example, strict=False)
                        for name, example in examples.items()}
        if len(set(lowerings.values())) == 1:
            edge = lowerings["prefill"](exported, metadata)
        else:  # each method lowered for its own target, then one program (the lowerings verified their own IR)
            edge = EdgeProgramManager({name: lowerings[name]({name: ep}, {}).exported_program(name)
                                       for name, ep in exported.items()}, constant_methods=metadata,
                                      compile_config=EdgeCompileConfig(_check_ir_validity=False))
        config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                                         emit_mutable_buffer_names=True, run_reinplace_pass=True)  # in-place writes
        return edge.to_executorch(config).buffer
