"""Bit-level helpers for the numba CPU kernels: reinterpret float32 <-> uint32, and a cache prefetch hint."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


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
