"""A small numpy interpreter for exactly the MIL ops npumoe's Core ML packages contain.

It runs the *saved* program (spec and weight blobs from :mod:`.mlpackage`), so on Linux the
engine executes what would ship to a device: the conversion, our passes, the compression
and the state updates are all inside what is tested. Each op computes in float32 and its
result is stored in the dtype the spec declares (fp16 for activations), which models the
ANE's fp16 storage between ops. Constexpr decompression runs once, at load.

An op outside :data:`OPS` is refused when the function is loaded, naming the op: never
skipped, never guessed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from npumoe.backends.apple_ane.mlpackage import NUMPY, Package, tensor_spec
from npumoe.core.base.errors import ArtifactError

VARIADIC = frozenset({"values"})  # params that take a list of values


def _f32(x):
    return np.asarray(x, dtype=np.float32)


def _index_slices(shape, begin, end, stride=None, begin_mask=None, end_mask=None):
    out = []
    for i, dim in enumerate(shape):
        b = 0 if begin_mask is not None and begin_mask[i] else int(begin[i])
        e = dim if end_mask is not None and end_mask[i] else int(end[i])
        s = 1 if stride is None else int(stride[i])
        out.append(slice(b + dim if b < 0 else b, e + dim if e < 0 else e, s))
    return out


def slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    y = x[tuple(_index_slices(x.shape, begin, end, stride, begin_mask, end_mask))]
    if squeeze_mask is not None and np.any(squeeze_mask):
        y = y.squeeze(axis=tuple(int(i) for i in np.flatnonzero(squeeze_mask)))
    return y


def slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    """x with x[begin:end] = update: the KV cache write (begin comes from ``position``)."""
    slices = _index_slices(x.shape, begin, end, stride, begin_mask, end_mask)
    if any(s.stop > d or s.start < 0 for s, d in zip(slices, x.shape)):
        raise ArtifactError(f"slice_update writes [{', '.join(f'{s.start}:{s.stop}' for s in slices)}] outside a "
                            f"tensor of shape {list(x.shape)}: the KV cache position is past the state's length.")
    target_shape = [len(range(s.start, s.stop, s.step)) for s in slices]
    out = np.array(x, copy=True)
    out[tuple(slices)] = np.reshape(update, target_shape)
    return out


def conv(x, weight, bias=None, strides=None, pad_type=None, pad=None, dilations=None, groups=1):
    """1×1 convolution, stride 1, one group: a linear layer in [1, C, 1, S] layout."""
    if weight.shape[2:] != (1, 1) or int(groups) != 1 or np.any(np.asarray(strides) != 1):
        raise ArtifactError(f"mil_exec runs 1×1, stride-1, single-group convs only (kernel {list(weight.shape)}).")
    y = np.einsum("oc,nchw->nohw", _f32(weight[:, :, 0, 0]), _f32(x))
    return y if bias is None else y + _f32(bias).reshape(1, -1, 1, 1)


def matmul(x, y, transpose_x=False, transpose_y=False):
    x, y = _f32(x), _f32(y)
    return np.matmul(np.swapaxes(x, -1, -2) if transpose_x else x, np.swapaxes(y, -1, -2) if transpose_y else y)


def softmax(x, axis=-1):
    x = _f32(x)
    e = np.exp(x - np.max(x, axis=int(axis), keepdims=True))
    return e / e.sum(axis=int(axis), keepdims=True)


def scaled_dot_product_attention(query, key, value, attn_mask=None):
    logits = matmul(query, key, transpose_y=True) / math.sqrt(query.shape[-1])
    if attn_mask is not None:
        logits = logits + (np.where(attn_mask, 0.0, -np.inf) if attn_mask.dtype == np.bool_ else _f32(attn_mask))
    return matmul(softmax(logits, -1), value)


def gelu(x, mode="EXACT"):
    x = _f32(x)
    if mode == "TANH_APPROXIMATION":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x / (1 + np.exp(-1.702 * x))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def blockwise_shift_scale(data, scale, offset=None):
    """constexpr_blockwise_shift_scale: (data − offset) · scale, scale and offset repeated per block."""
    scale = _f32(scale)
    offset = None if offset is None else _f32(offset)
    for axis, (d, s) in enumerate(zip(data.shape, scale.shape)):
        scale = np.repeat(scale, d // s, axis=axis)
        offset = None if offset is None else np.repeat(offset, d // offset.shape[axis], axis=axis)
    data = _f32(data)
    return (data if offset is None else data - offset) * scale


def lut_to_dense(indices, lut, vector_axis=None):
    """constexpr_lut_to_dense (iOS18), scalar palettes: each block of the output has its own LUT."""
    if lut.shape[-1] != 1:
        raise ArtifactError("mil_exec runs scalar palettes only (constexpr_lut_to_dense with VECTOR_SIZE 1).")
    k = indices.ndim
    groups = []
    for axis, (d, g) in enumerate(zip(indices.shape, lut.shape[:k])):
        shape = [1] * k
        shape[axis] = d
        groups.append((np.arange(d) // (d // g)).reshape(shape))
    return lut[..., 0][(*groups, indices.astype(np.int64))]


def _reduce(fn):
    return lambda x, axes=None, keep_dims=False: fn(
        _f32(x), axis=None if axes is None else tuple(int(a) for a in np.ravel(axes)), keepdims=bool(keep_dims))


def _split(x, num_splits=None, split_sizes=None, axis=0):
    axis = int(axis)
    sizes = list(split_sizes) if split_sizes is not None else [x.shape[axis] // int(num_splits)] * int(num_splits)
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=axis))


def _concat(values, axis, interleave=False):
    if interleave:
        raise ArtifactError("mil_exec does not run interleaved concat.")
    return np.concatenate(values, axis=int(axis))


def _write_state(input, data):
    input[...] = data
    return ()


OPS = {
    "conv": conv,
    "matmul": matmul,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "softmax": softmax,
    "add": lambda x, y: _f32(x) + _f32(y),
    "sub": lambda x, y: _f32(x) - _f32(y),
    "mul": lambda x, y: _f32(x) * _f32(y),
    "real_div": lambda x, y: _f32(x) / _f32(y),
    "pow": lambda x, y: _f32(x) ** _f32(y),
    "maximum": lambda x, y: np.maximum(_f32(x), _f32(y)),
    "minimum": lambda x, y: np.minimum(_f32(x), _f32(y)),
    "clip": lambda x, alpha, beta: np.clip(_f32(x), alpha, beta),
    "rsqrt": lambda x, epsilon=1e-12: 1.0 / np.sqrt(_f32(x) + np.float32(epsilon)),
    "sqrt": lambda x: np.sqrt(_f32(x)),
    "silu": lambda x: _f32(x) / (1.0 + np.exp(-_f32(x))),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-_f32(x))),
    "relu": lambda x: np.maximum(_f32(x), 0.0),
    "gelu": gelu,
    "reduce_mean": _reduce(np.mean),
    "reduce_sum": _reduce(np.sum),
    "reshape": lambda x, shape: np.reshape(x, [int(d) for d in shape]),
    "transpose": lambda x, perm: np.transpose(x, [int(p) for p in perm]),
    "concat": _concat,
    "split": _split,
    "slice_by_index": slice_by_index,
    "slice_by_size": lambda x, begin, size: x[tuple(
        slice(int(b), None if int(s) == -1 else int(b) + int(s)) for b, s in zip(begin, size))],
    "expand_dims": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in np.ravel(axes))),
    "squeeze": lambda x, axes=None: np.squeeze(x, None if axes is None else tuple(int(a) for a in np.ravel(axes))),
    "tile": lambda x, reps: np.tile(x, [int(r) for r in reps]),
    "identity": lambda x: x,
    "cast": lambda x, dtype: x,  # the declared output dtype does the cast
    "read_state": lambda input: np.array(input, copy=True),
    "write_state": _write_state,
    "slice_update": slice_update,
    "constexpr_blockwise_shift_scale": blockwise_shift_scale,
    "constexpr_lut_to_dense": lut_to_dense,
}


class Ref(NamedTuple):
    """An op argument bound to a named value (the alternative is an inline constant)."""

    name: str


def _execute(step, env: dict) -> None:
    impl, args, outs, dtypes = step

    def value(v):
        return env[v.name] if isinstance(v, Ref) else v

    result = impl(**{p: [value(v) for v in vs] if p in VARIADIC else value(vs[0]) for p, vs in args.items()})
    for name, out, dtype in zip(outs, result if isinstance(result, tuple) else (result,), dtypes):
        env[name] = np.asarray(out).astype(dtype, copy=False) if dtype is not None else out


class MilFunction:
    """One function of a saved package, ready to call: constants decoded and constexprs expanded."""

    def __init__(self, package: Package, name: str):
        self.name = name
        self.inputs = package.inputs(name)
        self.outputs = package.block_outputs(name)
        self.env: dict[str, object] = {}
        self.steps = []
        for op in package.operations(name):
            outs = [o.name for o in op.outputs]
            if op.type == "const":
                self.env[outs[0]] = package.value(op.attributes["val"])
                continue
            if op.type not in OPS:
                raise ArtifactError(
                    f"mil_exec cannot run MIL op {op.type!r} (function {name} of {package.path.name}); "
                    "npumoe's lowering never emits it, so this package was not built by npumoe build."
                )
            args = {param: [Ref(b.name) if b.WhichOneof("binding") == "name" else package.value(b.value)
                            for b in arg.arguments] for param, arg in op.inputs.items()}
            dtypes = [NUMPY.get(tensor_spec(o.type).dtype) if tensor_spec(o.type) else None for o in op.outputs]
            step = (OPS[op.type], args, outs, dtypes)
            if op.type.startswith("constexpr_"):
                _execute(step, self.env)  # inputs are constants: decompress once
            else:
                self.steps.append(step)

    def __call__(self, inputs: dict[str, np.ndarray], states: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once. ``states`` (name → array) are read and updated in place, as Core ML does."""
        env = dict(self.env)
        for name, spec in self.inputs.items():
            if spec.state:
                env[name] = states[name]
            elif name not in inputs:
                raise ArtifactError(f"function {self.name} needs input {name!r}; got {', '.join(sorted(inputs))}.")
            else:
                env[name] = np.asarray(inputs[name]).astype(NUMPY[spec.dtype], copy=False)
        for step in self.steps:
            _execute(step, env)
        return {name: env[name] for name in self.outputs}
