"""Bit-level helpers for the numba CPU kernels: reinterpret float32 <-> uint32, widen a stored element to
float32, float32 fused multiply-add and round-to-integer (the operations a vectorised library's formula is
written in), and a cache prefetch hint."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def as_float32(typingctx, bits):
    """The float32 whose bits are ``bits`` (a uint32)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@intrinsic
def as_uint32(typingctx, value):
    """The bits of ``value`` (a float32)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


def _call_float32(builder, name: str, values: list) -> ir.Value:
    """LLVM's float32 intrinsic ``name`` applied to ``values``."""
    f32 = ir.FloatType()
    function = builder.module.declare_intrinsic(name, [f32], ir.FunctionType(f32, [f32] * len(values)))
    return builder.call(function, values)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c in float32, rounded once (an FMA instruction), as a vectorised library built for FMA
    computes it."""

    def codegen(context, builder, signature, args):
        return _call_float32(builder, "llvm.fma", list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def rint(typingctx, x):
    """float32 ``x`` rounded to the nearest integer, ties to even (the CPU's default rounding mode)."""

    def codegen(context, builder, signature, args):
        return _call_float32(builder, "llvm.rint", list(args))

    return types.float32(types.float32), codegen


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the CPU to start loading the cache line holding ``array.flat[index]`` (C-contiguous) into its
    caches, for data whose address the hardware prefetcher cannot guess (pages anywhere in a pool)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        offset = builder.mul(args[1], context.get_constant(types.intp, signature.args[0].dtype.bitwidth // 8))
        address = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [offset])
        i32 = ir.IntType(32)
        hint = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        )
        # a read, kept in every cache level, of data
        builder.call(hint, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, types.intp), codegen


def widen(stored):
    """The float32 value of one stored element, typed by what is stored (see the overload): e4m3 bits
    (uint8) as their fields moved into bf16's, exact but 2^120 below their value; bf16 bits (uint16);
    float32 as it is; an int8 code as its integer (the entry's scale applies outside)."""


@overload(widen)
def _widen(stored):
    if stored == types.uint8:
        return lambda stored: as_float32(
            (((np.uint32(stored) & 0x7F) << 4) | ((np.uint32(stored) & 0x80) << 8)) << 16
        )
    if stored == types.uint16:  # bf16 bits are the high half of fp32's
        return lambda stored: as_float32(np.uint32(stored) << 16)
    if stored == types.float32:
        return lambda stored: stored
    if stored == types.int8:  # an INT8 entry's code
        return lambda stored: np.float32(stored)
    return None


def narrow(value, like):
    """The float32 ``value`` in the element type of the array ``like`` (see the overload): bf16 bits
    (uint16) rounded to nearest even as torch's CPU conversion rounds, or float32 as it is."""


@overload(narrow)
def _narrow(value, like):
    if like.dtype == types.uint16:

        def to_bf16(value, like):
            bits = as_uint32(value)
            if value != value:
                return np.uint16(0xFFFF)  # the NaN torch's vectorised conversion gives
            return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16)

        return to_bf16
    if like.dtype == types.float32:
        return lambda value, like: value
    return None


@intrinsic
def pointer(typingctx, address, like):
    """``address`` (an integer: a tensor's ``data_ptr()``) as a pointer to elements of the array ``like``'s
    type, for ``numba.carray``: a kernel reads a tensor's memory without a numpy array made per call."""
    pointer_type = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer_type))

    return pointer_type(address, like), codegen
