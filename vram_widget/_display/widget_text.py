"""The widget's words: the headline, the bar of what fills the peak, the detail rows and the
layers table, as HTML from an estimate and the numbers the widget searched for.

Plain functions of their arguments (no widget state), so each is tested on its own; the widget
(:mod:`.widget`) decides which numbers are ready and which still wait for the controls to rest.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence

import numpy as np

from .._estimating.estimator import LayerTable, MemoryEstimate
from .._estimating.options import Category, Device
from .figures import group_rows, output_shape_text

__all__ = [
    "PENDING",
    "Headline",
    "breakdown_bar_html",
    "fit_figure",
    "format_bytes",
    "format_count",
    "format_seconds",
    "headline_html",
    "replays_allocator",
    "rows_html",
    "table_html",
]

PENDING = "…"
"""What the headline shows for a number still being searched (it lands at rest)."""

# The colours of the bar's categories (plotly's default qualitative palette, in Category order)
_CATEGORY_COLOURS: dict[Category, str] = {
    Category.PARAMETER: "#1F77B4",
    Category.BUFFER: "#17BECF",
    Category.GRADIENT: "#FF7F0E",
    Category.OPTIMIZER_STATE: "#2CA02C",
    Category.ACTIVATION: "#D62728",
    Category.TEMPORARY: "#9467BD",
    Category.INPUT: "#8C564B",
    Category.COMMUNICATION: "#E377C2",
    Category.KV_CACHE: "#BCBD22",
}
_FITS = "#080"
_OVER = "#b00"
_TABLE_ROWS = 25


def format_bytes(nbytes: int | float) -> str:
    """Bytes in binary units, three significant digits.

    Examples
    --------
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    >>> format_bytes(512)
    '512 B'
    """
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}" if value >= 100 else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_count(n: float) -> str:
    """Large counts with an SI suffix and a trailing space (FLOPs, parameters).

    Examples
    --------
    >>> format_count(8.2e9) + "FLOP", format_count(12)
    ('8.2 GFLOP', '12 ')
    """
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.0f} "


def format_seconds(s: float) -> str:
    """A duration in s, ms or µs, three significant digits.

    Examples
    --------
    >>> format_seconds(0.0123), format_seconds(2.5e-6)
    ('12.3 ms', '2.5 µs')
    """
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fit_figure(est: MemoryEstimate) -> tuple[int | None, str]:
    """The one number compared with the card and what it measures, as the command line's
    total (``cli._Setting.fit_bytes``): ``device_bytes`` where the CUDA allocator is
    replayed (None here: that replay waits for the controls to rest), else ``total_bytes``
    ("allocated", plus the CUDA extras where there are any)."""
    if replays_allocator(est):
        return None, "device"
    label = "allocated" if est.extras.total_bytes == 0 else "allocated + extras"
    return est.total_bytes, label


def replays_allocator(est: MemoryEstimate) -> bool:
    """Whether ``est.allocator`` (and so ``device_bytes``) is a replay of the CUDA caching
    allocator, known without running it (the condition of ``MemoryEstimate.replayed``)."""
    return est.device is Device.CUDA and est.event_storage is not None


@dataclasses.dataclass(frozen=True)
class Headline:
    """The numbers of the headline strip; None where a search has not landed yet."""

    gpu_name: str
    capacity_bytes: int
    fit_bytes: int | None
    fit_label: str
    fits: bool | None
    largest_batch: int | None
    # the longest sequence at this batch (None: pending or no sequence axis: has_seq_axis)
    longest_seq: int | None
    has_seq_axis: bool
    generating: bool
    flops: int
    batch_size: int
    # tokens per step (batch x length; a generation's new tokens x batch), or None
    tokens_count: int | None
    # the CUDA context alone fills the card
    below_context_bytes: int | None = None
    # in place of a longest sequence that is not searched for (why), at rest
    longest_seq_note: str = ""
    # in place of a largest batch that is not searched for (why), at rest
    largest_batch_note: str = ""
    # why the last setting could not be estimated (the state shown is the one before)
    error: str = ""


def _pending(value: int | None, text: str) -> str:
    return f"<span class='vw-pending' title='updating…'>{PENDING}</span>" if value is None else text


def headline_html(h: Headline) -> str:
    """The answer first: the verdict on the card, the number that decides it, the largest
    batch (and longest sequence), the step's FLOPs and tokens or samples.

    Examples
    --------
    >>> h = Headline(gpu_name="T4 16GB", capacity_bytes=16 * 2**30, fit_bytes=2**30,
    ...              fit_label="allocated", fits=True, largest_batch=64, longest_seq=None,
    ...              has_seq_axis=False, generating=False, flops=4 * 10**9, batch_size=8,
    ...              tokens_count=None)
    >>> text = headline_html(h)
    >>> "<b>fits</b>" in text, "<b>1.00 GiB</b> allocated (6%) of 16.00 GiB" in text
    (True, True)
    >>> "largest batch <b>64</b>" in text, "<b>4 GFLOP</b> and 8 samples per step" in text
    (True, True)
    """
    card = html.escape(h.gpu_name)
    if h.fits is None:
        verdict = f"<span class='vw-verdict' style='color:#666'><b>{PENDING}</b></span>"
    elif h.fits:
        verdict = f"<span class='vw-verdict' style='color:{_FITS}'><b>fits</b></span>"
    else:
        verdict = f"<span class='vw-verdict' style='color:{_OVER}'><b>does not fit</b></span>"
    share = "" if h.fit_bytes is None else f" ({h.fit_bytes / h.capacity_bytes:.0%})"
    figure = _pending(h.fit_bytes, f"<b>{format_bytes(h.fit_bytes or 0)}</b>")
    cells = [
        f"{verdict} {card}",
        f"<span class='vw-fit'>{figure} {html.escape(h.fit_label)}{share} of "
        f"{format_bytes(h.capacity_bytes)}</span>",
    ]
    word = "most sequences at once" if h.generating else "largest batch"
    if h.below_context_bytes is not None:
        cells.append(
            f"<span class='vw-largest'>the capacity is below the CUDA context alone "
            f"({format_bytes(h.below_context_bytes)})</span>"
        )
    elif h.largest_batch_note:
        cells.append(f"<span class='vw-largest'>{word} {html.escape(h.largest_batch_note)}</span>")
    elif h.largest_batch == 0:
        cells.append("<span class='vw-largest'>not even batch size 1 fits</span>")
    elif h.largest_batch_note:
        cells.append(f"<span class='vw-largest'>{word} {html.escape(h.largest_batch_note)}</span>")
    else:
        largest = _pending(h.largest_batch, f"<b>{h.largest_batch or 0:,}</b>")
        cells.append(f"<span class='vw-largest'>{word} {largest}</span>")
    if h.has_seq_axis and h.below_context_bytes is None:
        what = "longest prompt" if h.generating else "longest sequence"
        longest = html.escape(h.longest_seq_note) or _pending(
            h.longest_seq, f"<b>{h.longest_seq or 0:,}</b>"
        )
        cells.append(f"<span class='vw-longest'>{what} {longest} at batch {h.batch_size:,}</span>")
    per = "generation" if h.generating else "step"
    work = (
        f"{h.tokens_count:,} tokens"
        if h.tokens_count is not None
        else f"{h.batch_size:,} sample{'s' if h.batch_size != 1 else ''}"
    )
    cells.append(
        f"<span class='vw-work'><b>{format_count(h.flops)}FLOP</b> and {work} per {per}</span>"
    )
    strip = " &nbsp;·&nbsp; ".join(cells)
    error = (
        f"<div class='vw-error' style='color:{_OVER}'>{html.escape(h.error)}</div>"
        if h.error
        else ""
    )
    return f"<div class='vw-headline' style='font-size:1.15em;line-height:1.6'>{strip}</div>" + (
        error
    )


def breakdown_bar_html(est: MemoryEstimate) -> str:
    """A horizontal stacked bar of what fills the peak, by category (``peak_breakdown``),
    each part as wide as its share, with its name and size beside the bar.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(8)
    >>> "Parameter" in breakdown_bar_html(est)
    True
    """
    parts = [(c, est.peak_breakdown.get(c, 0)) for c in Category]
    parts = [(c, n) for c, n in parts if n > 0]
    total = sum(n for _, n in parts) or 1
    bar = "".join(
        f"<div title='{c.value}: {n:,} B' style='width:{100 * n / total:.3f}%;"
        f"background:{_CATEGORY_COLOURS[c]}'></div>"
        for c, n in parts
    )
    legend = " ".join(
        f"<span style='white-space:nowrap'><span style='color:{_CATEGORY_COLOURS[c]}'>■</span>"
        f" {c.value} {format_bytes(n)}</span>"
        for c, n in parts
    )
    return (
        "<div class='vw-bar' style='display:flex;height:14px;width:100%;border-radius:3px;"
        f"overflow:hidden;background:#eee'>{bar}</div>"
        f"<div class='vw-bar-legend' style='font-size:0.9em'>At the peak "
        f"({format_bytes(est.peak_bytes)}): {legend}</div>"
    )


def rows_html(rows: Sequence[tuple[str, str]]) -> str:
    """Labelled rows (label, HTML) as a two-column table.

    Examples
    --------
    >>> text = rows_html([("Peak", "1.00 GiB")])
    >>> text.count("<tr>"), "<th>Peak</th><td>1.00 GiB</td>" in text
    (1, True)
    """
    body = "".join(
        f"<tr><th>{html.escape(label)}</th><td>{value}</td></tr>" for label, value in rows
    )
    return (
        "<style>.vw-details th,.vw-details td{text-align:left;vertical-align:top;"
        f"padding:2px 8px}}</style><table class='vw-details'>{body}</table>"
    )


def table_html(layers: LayerTable, depth: int) -> str:
    """The largest module groups at ``depth`` (numpy ranking, few rows)."""
    groups = group_rows(layers.depth, depth)
    n = len(groups)
    cols = {
        "params": layers.param_count,
        "param B": layers.param_bytes,
        "grad B": layers.gradient_bytes,
        "opt state B": layers.optimizer_state_bytes,
        "activation B": layers.activation_bytes,
        "fwd FLOPs": layers.flops_forward,
        "bwd FLOPs": layers.flops_backward,
    }
    sums = {k: np.bincount(groups, weights=v, minlength=n) for k, v in cols.items()}
    total = sums["param B"] + sums["grad B"] + sums["opt state B"] + sums["activation B"]
    heads = np.flatnonzero(groups == np.arange(n))
    order = heads[np.argsort(-total[heads], kind="stable")][:_TABLE_ROWS]
    heads_row = ("module", "type", "output", "activations", *cols)
    head = "".join(f"<th>{h}</th>" for h in heads_row)
    body = []
    numel = layers.output_numel
    for i, shape in zip(order.tolist(), output_shape_text(layers, order), strict=True):
        cells = [
            html.escape(layers.name[i] or "(model)"),
            html.escape(layers.type[i]),
            html.escape(shape),
            f"{int(numel[i]):,}" if shape else "",
            *(f"{round(sums[k][i]):,}" for k in cols),
        ]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        f"<p>{len(heads)} groups at depth {depth}; activations: elements of the "
        f"group's output at this batch; full table: "
        f"<code>w.to_dataframe()</code> / <code>w.to_csv(path)</code></p>"
    )


def optimizer_text(est: MemoryEstimate, implementation_asked: bool) -> str:
    """The optimizer of a training estimate, the implementation that ran (the one asked,
    or torch's default on the device) and how it steps, where not the default."""
    if not est.optimizer:
        return ""
    text = f", optimizer {est.optimizer.value}"
    impl = est.optimizer_implementation
    if impl is not None:
        text += f" ({impl}" + (
            "" if implementation_asked else f": torch's default on {est.device.value}"
        )
        text += ")"
    if est.levers.in_backward is not None:
        text += ", stepped in the backward (each parameter in its gradient's hook)"
    if not est.levers.set_to_none:
        text += ", gradients kept between steps (zero_grad(set_to_none=False))"
    return html.escape(text, quote=False)


def generation_text(est: MemoryEstimate) -> str:
    """A generation's shape, its KV cache and the step of its peak."""
    generation = est.generation
    assert generation is not None
    prompt = est.seq_len or 0
    step = (
        "the prefill of the prompt"
        if not est.peak_step
        else f"decode step {est.peak_step:,} of {generation.new_tokens - 1:,}"
    )
    return (
        f"{est.batch_size:,} sequences x (a prompt of {prompt:,} tokens + "
        f"{generation.new_tokens:,} new); <b>KV cache</b> "
        f"{format_bytes(generation.kv_cache_bytes)} after the last step, "
        f"{format_bytes(generation.kv_cache_bytes_per_token)} per token per sequence; "
        f"the peak is in {step}"
    )


def allocator_text(est: MemoryEstimate) -> str:
    """The caching allocator's view (CUDA): what it reserves at its peak, the gap to the
    whole blocks in use, and the other expandable_segments setting; empty on CPU."""
    shown = est.allocator
    other = est.replayed(expandable_segments=not est.expandable_segments)
    if shown is None or other is None:
        return ""
    gap = shown.peak_reserved_bytes - shown.peak_allocated_bytes
    delta = other.peak_reserved_bytes - shown.peak_reserved_bytes
    setting = "expandable_segments:" + ("False" if est.expandable_segments else "True")
    return (
        f"{format_bytes(shown.peak_reserved_bytes)} at the caching allocator's peak"
        f"{' (expandable segments)' if est.expandable_segments else ''} for "
        f"{format_bytes(shown.peak_allocated_bytes)} of whole blocks in use; "
        f"{format_bytes(gap)} is fragmentation and segment rounding; with {setting}: "
        f"{format_bytes(other.peak_reserved_bytes)} ({'+' if delta >= 0 else '-'}"
        f"{format_bytes(abs(delta))}); replayed, not yet checked on a GPU"
    )


def device_text(est: MemoryEstimate, gpu_name: str, capacity_bytes: int) -> str:
    """Allocated -> reserved -> device: the third of the three numbers (CUDA)."""
    device = est.device_bytes
    replayed = est.allocator
    assert device is not None and replayed is not None
    context = est.extras.cuda_context_bytes
    share = f" ({device / capacity_bytes:.0%} of {html.escape(gpu_name)})"
    return (
        f"<b>{format_bytes(device)}</b>{share} (what an out-of-memory error decides on) = the "
        f"least the caching allocator can reserve and still run the step, releasing its "
        f"cached segments ({format_bytes(device - context)}), + the CUDA context "
        f"({format_bytes(context)}). Allocated {format_bytes(est.peak_bytes)} -> reserved "
        f"{format_bytes(replayed.peak_reserved_bytes)} (nothing released) -> device"
    )


def levers_text(est: MemoryEstimate, base: MemoryEstimate) -> str:
    """What the active levers save and cost against ``base``, the same step without them."""
    saved = base.peak_bytes - est.peak_bytes
    change = "saves" if saved >= 0 else "adds"
    flops = est.flops / base.flops - 1 if base.flops else 0.0
    line = (
        f"{html.escape(est.levers.describe())}: {change} {format_bytes(abs(saved))} at the "
        f"peak ({format_bytes(base.peak_bytes)} without), FLOPs {flops:+.0%}"
    )
    if est.levers.grad_accumulation > 1:
        k = est.levers.grad_accumulation
        line += f"; effective batch {k} x {est.batch_size:,} = {k * est.batch_size:,}"
    return line


def host_row(est: MemoryEstimate) -> tuple[str, str] | None:
    """The details' row of the host memory offloaded activations take at their peak
    (``est.host_bytes``; None where nothing is offloaded). torchtune's OffloadActivations
    pins it (``use_pin_memory=True``, torchtune 0.6.1
    ``training/_activation_offloading.py``); ``save_on_cpu`` does not (``pin_memory=False``,
    torch's default, ``torch/autograd/graph.py``).

    Examples
    --------
    >>> import dataclasses
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,)).estimate(
    ...     64, offload_activations="torchtune")
    >>> host_row(est)[0]
    'Host (pinned) memory'
    >>> host_row(dataclasses.replace(est, host_bytes=0)) is None
    True
    """
    if not est.host_bytes:
        return None
    pinned = est.levers.offload_activations == "torchtune"
    how = (
        "pinned by torchtune's OffloadActivations"
        if pinned
        else "pageable: torch.autograd.graph.save_on_cpu(pin_memory=False)"
    )
    text = (
        f"{format_bytes(est.host_bytes)} ({est.host_bytes:,} B) of offloaded saved "
        f"activations at their peak, {html.escape(how)}; in no device total"
    )
    return ("Host (pinned) memory" if pinned else "Host memory", text)


def data_parallel_text(est: MemoryEstimate) -> str:
    """One rank of a data-parallel step: ranks, strategy, buffers, global batch."""
    which = f"rank {est.rank}" if est.rank is not None else "each rank"
    return (
        f"{est.gpus:,} GPUs, {est.strategy}; shown: {which} (the peak per GPU), with "
        f"{format_bytes(est.communication_bytes)} of communication buffers; global batch "
        f"{est.gpus:,} x {est.batch_size:,} = {est.gpus * est.batch_size:,}"
        + (
            f"; beside the totals, NCCL's own buffers ~{format_bytes(est.nccl.nbytes)} "
            f"(outside the allocator: {html.escape(est.nccl.describe())})"
            if est.nccl is not None
            else ""
        )
    )


def extras_text(est: MemoryEstimate) -> str:
    """The accelerator extras, each with its size, and allocated + extras."""
    x = est.extras
    source = (
        f' <span title="{html.escape(x.cuda_context_source)}">'
        f"({html.escape(x.cuda_context_source.partition(':')[0])})</span>"
        if x.cuda_context_source
        else ""
    )
    return (
        f"CUDA context {format_bytes(x.cuda_context_bytes)}{source}, cuBLAS workspace "
        f"{format_bytes(x.cublas_workspace_bytes)}, allocator rounding "
        f"{format_bytes(x.allocator_rounding_bytes)}; allocated + extras "
        f"{format_bytes(est.total_bytes)}"
        # what "fits" compares with the card: this on the CPU, the device row on CUDA
        + (" (the number compared with the card)" if not replays_allocator(est) else "")
    )


def flops_text(est: MemoryEstimate) -> str:
    """FLOPs, MACs and the forward / backward split."""
    return (
        f"{format_count(est.flops)}FLOP ({format_count(est.macs)}MAC; forward "
        f"{format_count(est.flops_forward)}FLOP, backward {format_count(est.flops_backward)}FLOP)"
    )


def step_time_text(est: MemoryEstimate, flops_per_s: float | None) -> str:
    """The compute-bound lower bound of the step's time at the card's dense peak rate."""
    if not flops_per_s:
        return "no FLOP rate for this device"
    t = est.flops / flops_per_s
    speed = f"{est.batch_size / t:,.0f} samples/s" if t > 0 else "n/a"
    if est.generation is not None and t > 0:  # compute-bound; decoding rarely is
        speed = f"{est.batch_size * est.generation.new_tokens / t:,.0f} new tokens/s"
    return (
        f"&ge; {format_seconds(t)} at {flops_per_s / 1e12:g} TFLOP/s (dense peak); at most {speed}"
    )
