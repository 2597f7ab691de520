"""Reading an XLA program's HLO text: the attention kernels it calls, per layer, and its collectives by kind.

Both `lower` (the HLO of the lowered module, before any partitioning) and `compile` (the compiled program,
after the compiler's passes) read the same text form. Each HLO instruction carries the JAX name stack it
came from in its `op_name` metadata: `jit(train)/jvp(Classifier)/encoder/stack/layers_3/self_attn/...` for
an unrolled stack, `.../stack/layers/...` for a scanned one (one loop body for every layer, so what it holds
counts for all of them), with `transpose(...)` around what the backward pass computes.

An attention kernel is a custom call: a Mosaic kernel on a TPU (`tpu_custom_call`, its instruction named
after the kernel: `splash_mha_fwd_residuals`, `splash_mha_dkv_no_residuals`, ...), cuDNN's fused attention on
an NVIDIA GPU (`__cudnn$fmha...`), a Triton kernel (`__gpu$xla.gpu.triton` before compiling). The kernels
that are plain XLA operations (xla, dense, chunked, unfused, context) leave none.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
REDUCE_SCATTER_FUSION = "all-reduce-scatter"

# What each attention kernel leaves in a program (jaxblock/attention/dispatch.py names the kernels), by
# custom-call target; None for kernels that are plain XLA operations.
KERNEL_TARGETS: dict[str, tuple[str, ...] | None] = {
    "splash": ("tpu_custom_call",),
    "pallas_gpu": ("__gpu$xla.gpu.triton", "__triton"),
    "cudnn": ("__cudnn$fmha",),
    "context": None,
    "xla": None,
    "dense": None,
    "chunked": None,
    "unfused": None,
}
_ATTENTION_TARGETS = tuple(t for targets in KERNEL_TARGETS.values() if targets for t in targets)

# A computation starts at a line of its own ("%name (...) -> ... {", "ENTRY %main ... {", or without the %s
# before compiling); an instruction at "  %name = ..." or "  name = ..." and may run over several lines (a
# kernel's metadata). Calls name their computations as to_apply=, calls=, body=, condition=, branch lists.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+)(?: \(.*\) -> .*)? \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<rest>.*)$", re.S)
_OPCODE = re.compile(r"(?:^|\s)(?P<op>[a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_LAYER = re.compile(r"/layers(?:_(?P<index>\d+))?/")


class Instruction:
    __slots__ = ("computation", "name", "op", "text")

    def __init__(self, computation: str, name: str, op: str, text: str):
        self.computation, self.name, self.op, self.text = computation, name, op, text

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.text)
        return m["op_name"] if m else ""

    def called(self) -> list[str]:
        names = _CALLED.findall(self.text)
        for group in _CALLED_LISTS.findall(self.text):
            names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
        return names


@contextlib.contextmanager
def name_stacks() -> Iterator[None]:
    """While a program is lowered: its locations, which become the HLO op_names, carry the full name stack.
    With `jax_include_full_tracebacks_in_locations` off (JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=0), an op's
    location is its own name, without the layer it runs in."""
    name = "jax_include_full_tracebacks_in_locations"
    before = getattr(jax.config, name)
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, before)


def parse(hlo: str) -> list[Instruction]:
    """Every instruction of every computation of HLO text, in order."""
    out: list[Instruction] = []
    computation = ""
    current: list[str] = []

    def flush() -> None:
        if current:
            m = _INSTRUCTION.match("\n".join(current))
            op = _OPCODE.search(m["rest"]) if m else None
            if m and op:
                out.append(Instruction(computation, m["name"], op["op"], "\n".join(current)))
            current.clear()

    for line in hlo.splitlines():
        header = _COMPUTATION.match(line) if not line.startswith(" ") else None
        if header is not None:
            flush()
            computation = header["name"]
        elif _INSTRUCTION.match(line) and line.startswith(" "):
            flush()
            current.append(line)
        elif current and line.strip() not in ("}", ""):
            current.append(line)
        else:
            flush()
    flush()
    return out


def instructions(hlo: str) -> Iterator[tuple[str, str, str]]:
    """(name, opcode, text) of every instruction of every computation of HLO text."""
    for ins in parse(hlo):
        yield ins.name, ins.op, ins.text


def collectives(hlo: str) -> dict[str, int]:
    """Collectives by kind. A synchronous op and the start of an asynchronous pair count, its done does not;
    an op the compiler copies into several computations counts once per channel. Static counts: a collective
    in a loop body (a scanned stack) counts once, not once per iteration. Over groups of one device (what a
    shard_map over an axis it does not split leaves) it is no communication and does not count."""
    seen: set[tuple[str, str]] = set()
    counts = dict.fromkeys(COLLECTIVES, 0)
    for ins in parse(hlo):
        kind, text = ins.op.removesuffix("-start"), ins.text
        if kind not in counts or _single_device_groups(text):
            continue
        channel = re.search(r"channel_id=(\d+)", text)
        key = (kind, channel[1] if channel else ins.name)
        if kind == "all-reduce" and ins.computation.startswith(REDUCE_SCATTER_FUSION):
            # The TPU compiler writes a reduce-scatter as an all-reduce inside a computation of this name whose
            # result is the caller's shard (each such computation its own, their channel ids alike).
            kind, key = "reduce-scatter", ("reduce-scatter", ins.computation)
        if key not in seen:
            seen.add(key)
            counts[kind] += 1
    return counts


def _single_device_groups(text: str) -> bool:
    groups = re.search(r"replica_groups=(\{[^=]*?\}\}|\[[^=]*?\](?:<=\[[^\]]*\])?)", text)
    if groups is None:
        return False
    value = groups[1]
    if value.startswith("["):  # iota form [groups,size]<=[...]
        shape = re.match(r"\[(\d+),(\d+)\]", value)
        return shape is not None and shape[2] == "1"
    return all("," not in g for g in re.findall(r"\{([^{}]*)\}", value))


class Call:
    """One attention custom call: its target, kernel name, layer (None: outside the stack, 'all': the scanned
    stack's body) and whether the backward pass computes it."""

    __slots__ = ("backward", "layer", "name", "target")

    def __init__(self, target: str, name: str, layer: int | str | None, backward: bool):
        self.target, self.name, self.layer, self.backward = target, name, layer, backward

    def describe(self) -> str:
        return f"{self.name or self.target}{' (backward)' if self.backward else ''}"


def attention_calls(hlo: str) -> list[Call]:
    """Every custom call of an attention kernel in HLO text, once per layer it runs for. Its layer comes from
    the name stack: its own op_name, or (before compiling, where a computation's op_names are relative to
    it) the op_names of the calls that lead to its computation; one computation called from several layers
    runs for each of them."""
    program = parse(hlo)
    callers: dict[str, list[Instruction]] = collections.defaultdict(list)
    for ins in program:
        for name in ins.called():
            callers[name].append(ins)
    memo: dict[str, set[tuple[int | str | None, bool]]] = {}

    def contexts(computation: str, seen: frozenset[str] = frozenset()) -> set[tuple[int | str | None, bool]]:
        """(layer, backward) of every way the program reaches `computation` from its entry."""
        if computation in memo:
            return memo[computation]
        sites = [c for c in callers.get(computation, []) if c.computation not in seen]
        found: set[tuple[int | str | None, bool]] = set()
        if not sites:
            found.add((None, False))
        else:
            for site in sites:
                for layer, backward in contexts(site.computation, seen | {computation}):
                    found.add(_step(layer, backward, site.op_name))
        memo[computation] = found
        return found

    out = []
    for ins in program:
        if ins.op != "custom-call":
            continue
        target_match = re.search(r'custom_call_target="([^"]+)"', ins.text)
        target = target_match[1] if target_match else ""
        if not target.startswith(_ATTENTION_TARGETS):
            continue
        for layer, backward in sorted(contexts(ins.computation), key=str):
            layer, backward = _step(layer, backward, ins.op_name)
            out.append(Call(target, _kernel_name(ins, target), layer, backward))
    return out


def _step(layer: int | str | None, backward: bool, op_name: str) -> tuple[int | str | None, bool]:
    """(layer, backward) after a name stack segment: its own layer wins over the enclosing one."""
    m = _LAYER.search(op_name)
    if m is not None:
        layer = int(m["index"]) if m["index"] is not None else "all"
    return layer, backward or "transpose(" in op_name


def _kernel_name(instruction: Instruction, target: str) -> str:
    """A Pallas kernel's name (Mosaic or Triton): its op_name ends ".../<kernel>/pallas_call"; a compiled
    Mosaic instruction is also named after it. Other custom calls go by their target."""
    segments = [s for s in instruction.op_name.split("/") if s]
    if len(segments) >= 2 and segments[-1] == "pallas_call":
        return segments[-2]
    if target == "tpu_custom_call":
        return re.sub(r"(\.\d+)+$", "", instruction.name)
    return target


def calls_by_layer(hlo: str, num_layers: int) -> dict[int, list[Call]]:
    """{layer: its attention calls}; a scanned stack's calls count for every layer."""
    out: dict[int, list[Call]] = collections.defaultdict(list)
    for call in attention_calls(hlo):
        layers = range(num_layers) if call.layer == "all" else [call.layer] if isinstance(call.layer, int) else []
        for i in layers:
            out[i].append(call)
    return {i: out.get(i, []) for i in range(num_layers)}


def holds(kernel: str, calls: list[Call]) -> bool:
    """Whether a layer's calls are what `kernel` leaves: one of its custom calls, or, for a kernel of plain
    XLA operations, no attention custom call at all."""
    targets = KERNEL_TARGETS.get(kernel)
    if targets is None:
        return not calls
    return any(call.target.startswith(targets) for call in calls)


class MemoryReport:
    """The compiler's memory usage report of one compile (XLA's buffer assignment, which the compile itself
    dumps into a directory of its own): its largest allocations and the arrays that share each. The report
    is written when the compiler refuses a program for want of memory too, which is when it is wanted most."""

    def __init__(self, directory: str):
        self.directory = directory
        # One compile's debug options: the dump holds the optimized module and its buffer assignment, no pass.
        self.options = {"xla_dump_to": directory, "xla_dump_hlo_pass_re": "^$"}

    def live_at_peak(self) -> int | None:
        """The bytes live at the program's peak by the compiler's own live ranges (the `*live-range.txt` of
        its buffer assignment: every value live at that point, the arguments in use included): the floor the
        step's schedule holds, where the temporaries figure is the heap, which also holds the gaps of its
        packing. None where the compiler wrote no live ranges."""
        for path in sorted(Path(self.directory).glob("*live-range.txt"), reverse=True):
            m = _PEAK_BREAKDOWN.search(path.read_text())
            if m is not None:
                return int(m.group(1).replace(" ", ""))
        return None

    def largest(self, count: int = 3) -> list[str]:
        """'477.0 MiB: f32[32,125,30523], bf16[32,512,3,12,64]' for the `count` largest allocations."""
        reports = sorted(Path(self.directory).glob("*memory-usage-report.txt"))
        if not reports:
            return []
        out = []
        for line in reports[-1].read_text().splitlines():
            m = _REPORT_ROW.match(line)
            if m is None:
                continue
            shapes = [s.strip() for s in m["shapes"].split(", ")]
            shown = ", ".join(shapes[:3]) + (", ..." if len(shapes) > 3 else "")
            out.append(f"{m['size']}: {shown}")
            if len(out) == count:
                break
        return out


_PEAK_BREAKDOWN = re.compile(r"Stack trace breakdown for peak usage:\s*([\d ]+)\s*bytes")

_REPORT_ROW = re.compile(
    r"^\s*[\d.]+[KMGT]?i?B\(\s*\d+%\);\s*"  # running total and its share
    r"(?P<size>[\d.]+[KMGT]?i?B);\s*\d+;\s*\d+;\s*"  # this allocation, then two counts
    r"(?P<shapes>.+)$"
)


@contextlib.contextmanager
def memory_report(keep: str | None = None) -> Iterator[MemoryReport]:
    """A MemoryReport whose `options` a compile takes (`lowered.compile(compiler_options=...)`). The dump is
    removed afterwards, unless `keep` names the directory to write it to (`compile --dump`)."""
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield MemoryReport(keep)
        return
    directory = tempfile.mkdtemp(prefix="jaxblock-compile-")
    try:
        yield MemoryReport(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
