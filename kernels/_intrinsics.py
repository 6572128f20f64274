"""Device intrinsics numba does not provide."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic


@intrinsic
def _globaltimer(typingctx: Any) -> Any:
    """The GPU's global nanosecond timer (PTX ``%globaltimer``), as a uint64."""
    sig = types.uint64()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l", side_effect=True)
        return builder.call(asm, [])

    return sig, codegen


# Called as globaltimer() inside kernels (numba supplies the typing context).
globaltimer: Any = _globaltimer
