"""Which parameters a kernel function writes, read from its bytecode.

Tensor arguments of a launch are read-only inputs; partitions are the outputs. A kernel
that stores into a parameter (``z[i] = ...``, ``z[i] += ...``, ``z[a:b] = ...``,
``cuda.atomic.add(z, ...)``, also through a local alias ``w = z``) is refused when it is
launched with a tensor there, before any work, on every backend.

The analysis follows the value stack of the bytecode in order, remembering which stack
entries are parameters. It can miss a write hidden behind a call (a device function that
writes its argument): on CUDA such a kernel is still refused when it is built (tensor
arguments are compiled read-only), on the simulated device the write faults. It never
reports a parameter that the function does not store into.
"""

from __future__ import annotations

import dis
import types
from typing import Any

__all__ = ["written_params"]

_ATOMIC_NS = "<atomic namespace>"
_ATOMIC_FN = "<atomic function>"
_cache: dict[types.CodeType, frozenset[int]] = {}


def written_params(fn: Any) -> frozenset[int]:
    """Positions of the parameters of ``fn`` that its body stores into."""
    code = fn.__code__
    hit = _cache.get(code)
    if hit is None:
        hit = _cache[code] = _analyse(code)
    return hit


def _analyse(code: types.CodeType) -> frozenset[int]:
    params = code.co_varnames[: code.co_argcount]
    alias: dict[str, str] = {p: p for p in params}
    stack: list[Any] = []
    written: set[str] = set()

    def pop(n: int) -> list[Any]:
        out = stack[len(stack) - n :] if n else []
        del stack[max(0, len(stack) - n) :]
        return [None] * (n - len(out)) + out

    for ins in dis.get_instructions(code):
        op = ins.opname
        arg = ins.argval
        if op in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_BORROW"):
            stack.append(alias.get(arg))
            continue
        if op in ("LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"):
            a, b = arg
            stack.append(alias.get(a))
            stack.append(alias.get(b))
            continue
        if op == "STORE_FAST":
            (v,) = pop(1)
            if v in params:
                alias[arg] = v
            else:
                alias.pop(arg, None)
            continue
        if op == "STORE_FAST_STORE_FAST":
            for name in arg:
                (v,) = pop(1)
                if v in params:
                    alias[name] = v
                else:
                    alias.pop(name, None)
            continue
        if op == "STORE_SUBSCR":  # container[index] = value: TOS1 is the container
            _, container, _ = pop(3)
            if container in params:
                written.add(container)
            continue
        if op == "STORE_SLICE":  # container[start:stop] = value
            _, container, _, _ = pop(4)
            if container in params:
                written.add(container)
            continue
        if op == "COPY":
            stack.append(stack[-arg] if len(stack) >= arg else None)
            continue
        if op == "SWAP":
            if len(stack) >= arg:
                stack[-1], stack[-arg] = stack[-arg], stack[-1]
            continue
        if op in ("LOAD_ATTR", "LOAD_METHOD"):
            name = arg if isinstance(arg, str) else getattr(arg, "argval", arg)
            effect = dis.stack_effect(ins.opcode, ins.arg, jump=False)
            (base,) = pop(1)
            tag = _ATOMIC_NS if name == "atomic" else _ATOMIC_FN if base == _ATOMIC_NS else None
            stack.extend([tag] * (effect + 1))
            continue
        if op in ("CALL", "PRECALL", "CALL_KW"):
            argc = ins.arg or 0
            extra = 1 if op == "CALL_KW" else 0  # the names tuple
            window = stack[len(stack) - (argc + 2 + extra) :]
            if _ATOMIC_FN in window[:2] and argc >= 1:
                first = window[2] if len(window) > 2 else None
                if first in params:
                    written.add(first)
        try:
            effect = dis.stack_effect(ins.opcode, ins.arg, jump=False)
        except ValueError:  # an opcode without a fixed effect: forget the stack
            stack.clear()
            continue
        n_pop, n_push = _pops_pushes(op, effect)
        pop(n_pop)
        stack.extend([None] * n_push)
    return frozenset(i for i, p in enumerate(params) if p in written)


_NEUTRAL = ("NOP", "RESUME", "EXTENDED_ARG", "CACHE", "KW_NAMES", "JUMP", "NOT_TAKEN", "COPY_FREE_VARS", "MAKE_CELL")


def _pops_pushes(op: str, effect: int) -> tuple[int, int]:
    """A split of a net stack effect into pops and pushes that never labels a result
    with a parameter: an op that pops operands is taken to push one unlabelled result."""
    if effect > 0:
        return 0, effect
    if effect == 0:
        return (0, 0) if op.startswith(_NEUTRAL) else (1, 1)
    return 1 - effect, 1
