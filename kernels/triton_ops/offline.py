"""Compile a Triton kernel for a GPU architecture on a machine without a GPU, and read
the registers, stack and shared memory its compiled form uses, or its SASS.

The Triton wheel carries the CUDA toolchain (ptxas, cuobjdump), so the CPU box compiles a
kernel for sm_90 as a device would (with this Triton version) and reads the cubin's resource
usage. Registers per thread decide how many programs share an SM: a change that takes the
attention walk past a register cap shows here as spilled stack, in CI, before any device
time is spent (the softmax chunks' second accumulator took `large`'s walk from three
programs per SM to two, +27% in prefill on the H200, and no CPU test saw it).

Invariant: the compile runs in a child process without `TRITON_INTERPRET` (under the
interpreter, kernels are not compilable objects); nothing is launched. Arguments are
specialised as a launch specialises them: every pointer, and the integers the caller names
(strides that are multiples of 16 at run time), divisible by 16. Without that, Triton cannot
prove the K/V rows' loads vectorisable and leaves them unpipelined: a different kernel. The
`tl.constexpr` parameters a request does not name compile at their defaults, as a launch
that omits them does (`_launch_constexprs`); one without a default is an error. An integer
that is 1 at launch (a unit stride: the linear kernels' `sx_k`, `sw_k`, `sy_n`) is
specialised to the constant 1 by the launch: name it among the constexprs, or the compile
keeps a runtime stride, and loses the vectorised, pipelined loads (the tree product's
default tile compiled so took 255 registers and spilled; as launched it takes 224, no
spill). The
figures are this Triton version's; a device with another version may allocate a few
registers differently.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel uses per thread (registers, stack bytes: spills and call
    frames) and per program (static shared bytes)."""

    registers: int
    stack: int
    shared: int

    @classmethod
    def from_cuobjdump(cls, text: str) -> KernelResources:
        fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", text))
        if not {"REG", "STACK", "SHARED"} <= fields.keys():
            raise RuntimeError(f"no resource usage in cuobjdump's output: {text[-500:]!r}")
        return cls(int(fields["REG"]), int(fields["STACK"]), int(fields["SHARED"]))


def compile_resources(
    kernel: str,
    types: dict[str, str],
    constexprs: dict[str, Any],
    options: dict[str, int],
    arch: int = 90,
    divisible: tuple[str, ...] = (),
) -> KernelResources:
    """Resources of `kernel` ("module:name" of a `@triton.jit` function) compiled for
    sm_`arch` with launch `options` (num_warps, num_stages, maxnreg). `types` gives each
    runtime argument's Triton type ("*bf16", "i32", "fp32", ...; unnamed ones are "i32");
    `constexprs` the compile-time ones; `divisible` the integer arguments a launch would see
    as multiples of 16 (pointers always are)."""
    out = _run_child(kernel, types, constexprs, options, arch, divisible, "resources")
    return KernelResources(**json.loads(out.strip().splitlines()[-1]))


def compile_sass(
    kernel: str,
    types: dict[str, str],
    constexprs: dict[str, Any],
    options: dict[str, int],
    arch: int = 90,
    divisible: tuple[str, ...] = (),
) -> str:
    """The SASS (`cuobjdump -sass`) of `kernel` compiled as `compile_resources` compiles it:
    what a walk's instruction count per step is read from."""
    return _run_child(kernel, types, constexprs, options, arch, divisible, "sass")


def compile_ir(
    kernel: str,
    types: dict[str, str],
    constexprs: dict[str, Any],
    options: dict[str, int],
    arch: int = 90,
    divisible: tuple[str, ...] = (),
    stage: str = "ttgir",
) -> str:
    """One intermediate form (`ttgir`, `llir`, `ptx`) of `kernel` compiled as
    `compile_resources` compiles it: where its shared-memory layouts (and their swizzles)
    can be read."""
    return _run_child(kernel, types, constexprs, options, arch, divisible, f"ir:{stage}")


def _run_child(
    kernel: str, types: dict[str, str], constexprs: dict[str, Any], options: dict[str, int],
    arch: int, divisible: tuple[str, ...], what: str,
) -> str:  # fmt: skip
    request = {
        "kernel": kernel, "types": types, "constexprs": constexprs, "options": options,
        "divisible": list(divisible), "what": what,
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU's default; silences a warning
    done = subprocess.run(
        [sys.executable, "-m", "rlsys.kernels.triton_ops.offline", str(arch)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offline compile of {kernel} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _launch_constexprs(kernel: str, params: list[Any], named: dict[str, Any]) -> dict[str, Any]:
    """The compile-time arguments as a launch gives them: the named ones, and every other
    `tl.constexpr` parameter at its default (a launch that omits it compiles it so). A
    constexpr left out of the signature would compile as a runtime integer, both sides of
    each branch on it kept: other registers, other SASS, and no error. One without a
    default is named as missing."""
    consts = dict(named)
    for p in params:
        if not p.is_constexpr or p.name in consts:
            continue
        if not p.has_default:
            raise ValueError(f"offline compile of {kernel}: constexpr {p.name} not given")
        consts[p.name] = p.default
    return consts


def _compile_in_this_process(request: dict[str, Any], arch: int) -> str:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = request["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    consts = _launch_constexprs(request["kernel"], fn.params, request["constexprs"])
    signature = {
        a: "constexpr" if a in consts else request["types"].get(a, "i32") for a in fn.arg_names
    }
    aligned = set(request["divisible"])
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()},
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, a in enumerate(fn.arg_names)
            if a not in consts and (signature[a].startswith("*") or a in aligned)
        },
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=request["options"])
    what = request.get("what", "")
    if what.startswith("ir:"):
        return compiled.asm[what[3:]]
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        flag = "-sass" if request.get("what") == "sass" else "--dump-resource-usage"
        dumped = subprocess.run(
            [os.path.join(tools, "cuobjdump"), flag, cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    if request.get("what") == "sass":
        return dumped
    return json.dumps(KernelResources.from_cuobjdump(dumped).__dict__)


if __name__ == "__main__":
    print(_compile_in_this_process(json.loads(sys.stdin.read()), int(sys.argv[1])))
