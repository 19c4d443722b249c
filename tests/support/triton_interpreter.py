"""Patches for gaps of the Triton 3.6 interpreter (``TRITON_INTERPRET=1``), applied by the
tests that run kernels on CPU. Test processes only: compiled kernels are untouched, and each
patch is a no-op where the interpreter already behaves."""

from __future__ import annotations


def patch_triton_interpreter() -> None:
    """Work around three Triton 3.6 interpreter gaps, and wrap the language's builtins once
    rather than at every launch (``_cache_builtin_lists``):

    * scalar tensors are 1-element arrays and become ``range`` bounds through ``int(array)``,
      which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream after 3.6);
    * bf16 values are held as raw ``uint16`` bits and ``tl.dot`` multiplies those bits as
      integers. Widening bf16 operands to fp32 first is what tensor cores compute (exact bf16
      products, fp32 accumulation);
    * fp32 -> bf16 casts truncate, where compiled kernels and torch round to nearest even.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        original = interpreter._patch_lang_tensor
        if not getattr(original, "_latentserve_patched", False):

            def patch_lang_tensor(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__",
                               lambda self: int(self.handle.data.reshape(-1)[0]))

            patch_lang_tensor._latentserve_patched = True
            interpreter._patch_lang_tensor = patch_lang_tensor

    builder = interpreter.InterpreterBuilder
    if not getattr(builder.create_dot, "_latentserve_patched", False):
        create_dot = builder.create_dot

        def widen(x):
            if x.dtype != tl.bfloat16:
                return x
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
            return interpreter.TensorHandle(data.view(np.float32), tl.float32)

        def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
            return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot_bf16._latentserve_patched = True
        builder.create_dot = create_dot_bf16
    _patch_bf16_rounding()
    _cache_builtin_lists()


def _cache_builtin_lists() -> None:
    """Each launch re-patches ``triton.language``'s builtins, finding them with
    ``inspect.getmembers`` and wrapping each anew: over half of the time the interpreter
    spends outside the kernels. A package's builtins and their wrappers (``_patch_attr``'s,
    bound to the one interpreter builder) do not change, so they are made on the first
    launch (nothing is patched then) and set on each launch as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._patch_builtin, "_latentserve_patched", False):
        return
    patch_attr, wrapped = interpreter._patch_attr, {}

    class Recorder:
        def __init__(self):
            self.values = []

        def set_attr(self, obj, name, value):
            self.values.append((name, value))

    def patch_builtin(pkg, builder, scope):
        key = (pkg, builder)
        if key not in wrapped:
            rec = Recorder()
            for name, member in inspect.getmembers(pkg):
                if tl.core.is_builtin(member):
                    patch_attr(pkg, name, member, builder, rec)
            wrapped[key] = rec.values
        for name, value in wrapped[key]:
            scope.set_attr(pkg, name, value)

    patch_builtin._latentserve_patched = True
    interpreter._patch_builtin = patch_builtin


def _patch_bf16_rounding() -> None:
    """Round fp32 -> bf16 casts to nearest even in the interpreter (through torch)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_latentserve_patched", False):
        return
    cast_impl = builder.cast_impl

    def cast_rounding(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            import torch

            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = bits.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    cast_rounding._latentserve_patched = True
    builder.cast_impl = cast_rounding
