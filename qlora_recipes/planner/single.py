"""The plan of one process: every block placed on its device (one GPU, the CPU, or a device map
across GPUs, CPU and disk), each component's bytes summed per device, each device's peak against
its budget, and the notes a reader needs; the content of plan.json before the ladder. A full
replica per GPU, which is right for a single process, DDP and ZeRO-2 (sharded.py rewrites it for
FSDP / ZeRO-3). Pure arithmetic unless a device map has to be inferred (placement.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import devices as _dev
from ..units import GiB, dtype_bytes
from . import moe
from .blocks import OUTPUT_HEAD
from .components import (
    BlockBytes,
    act_dtypes,
    backward_working_bytes,
    block_bytes,
    checkpoint_bytes,
    eager,
    eager_scores_bytes,
    eval_layer_bytes,
    keeps_views,
    layer_saved_bytes,
    offloaded_activations,
    optimizer_bytes,
    optimizer_shared_bytes,
    shared_per_device_bytes,
    unquantized_bytes,
)
from .constants import (
    ALLOCATOR_DYNAMIC_FRACTION,
    ALLOCATOR_STATIC_FRACTION,
    BNB_CPU_STEP_BYTES,
    CUDA_CONTEXT_BYTES,
    HEADROOM_TARGET,
    OPTIMIZERS,
)
from .loss import eval_loss_bytes, generation_bytes, reference_head_bytes, sampling_bytes, train_loss_bytes
from .peaks import COMPONENTS, STATIC, allocated_peak, allocator_bytes, device_entry, peak_allocated_gib, phase_peaks
from .placement import (
    OFFLOADED,
    dev_name,
    on_one_device,
    place,
    resolve_placement,
    rewrites_offloaded,
    unquantized_blocks,
)
from .process import baseline_source, cpu_process_baseline, kernel_bytes
from .spec import StackSpec, data_note
from .vision import add_vision_eval, add_vision_rows, add_vision_upcast


def _rows() -> defaultdict[str, defaultdict[str, int]]:
    return defaultdict(lambda: defaultdict(int))


@dataclass
class _Tally:
    """Bytes per component and device, and what the later rows need to know about the blocks."""

    lm_dev: str  # where lm_head computes: the logits and loss live there
    comp: defaultdict[str, defaultdict[str, int]] = field(default_factory=_rows)
    placed: dict[str, str] = field(default_factory=dict)
    layers_on: defaultdict[str, list[BlockBytes]] = field(default_factory=lambda: defaultdict(list))
    dequant_on: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    dora_on: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    cast_on: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    offloaded_max: int = 0  # the largest block computed away from where it is stored
    disk_max: int = 0  # the largest block on disk, as read
    disk_read: int = 0  # the bytes of every block on disk, as read (load dtype)
    host_cast_max: int = 0  # the fp32 host copy of the largest tensor onloaded from host RAM
    trainable_shapes: defaultdict[str, list] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(
        default_factory=lambda: dict(
            params_total=0, params_quantized=0, lora_params=0, footprint_at_load=0, quant_state_bytes=0
        )
    )


def plan_single(st: StackSpec, hw: _dev.Hardware) -> dict:
    """The plan of `st` on `hw` (plan.json without its ladder)."""
    notes: list[str] = []
    bbs = block_bytes(st)
    exec_dev, dmap, max_memory = resolve_placement(st, hw, bbs, notes)
    t = _tally_blocks(st, hw, bbs, dmap, exec_dev)
    comp = t.comp
    # a VLM's tower and projector (its adapters among the trainable tensors under model.vision_tower=lora)
    vision = add_vision_rows(st, comp, t.counts, exec_dev, notes, t.trainable_shapes[exec_dev])
    if t.disk_read and rewrites_offloaded(st):
        comp["other_params"]["disk"] += t.disk_read  # re-saved to offload.folder in the load dtype
    disk_bytes = sum(comp[k].get("disk", 0) for k in ("quantized_weights", "other_params", "buffers"))
    paged_total = _optimizer_rows(st, t)
    _activation_rows(st, t)
    _prep_rows(t)
    _load_rows(st, hw, t)
    add_vision_upcast(st, comp, vision, exec_dev, notes)
    if vision:
        add_vision_eval(st, comp, exec_dev)
    # offload staging: room on the execution device for one offloaded layer
    if t.offloaded_max and hw.has_gpu:
        comp["offload_staging"][exec_dev] += t.offloaded_max
    if t.disk_max or t.host_cast_max:
        comp["offload_staging"]["cpu"] += max(t.disk_max, t.host_cast_max)
    if on_one_device(st):
        dev_names = [exec_dev]
        if exec_dev != "cpu" and (comp["activations"].get("cpu") or comp["other_params"].get("cpu")):
            dev_names.append("cpu")  # activation offloading's layer inputs, offload.embeddings' table
    else:
        dev_names = [f"cuda:{i}" for i in range(len(hw.gpus))] + ["cpu"]
        if st.offload_folder or disk_bytes:
            dev_names.append("disk")
    for d in dev_names:
        if d.startswith("cuda"):
            comp["cuda_context"][d] += CUDA_CONTEXT_BYTES
        elif d == "cpu":
            comp["process_baseline"][d] += cpu_process_baseline()
            comp["cpu_kernels"][d] += kernel_bytes(st.dtype)
    devices = [_device(st, hw, comp, d, disk_bytes, max_memory) for d in dev_names]
    _notes(st, hw, t.placed, paged_total, t.disk_read, notes)
    return _plan_dict(st, hw, t, devices, dmap, max_memory, paged_total, notes)


def offloaded_working_bytes(st: StackSpec, blk) -> int:
    """An offloaded block on the execution device in its backward: the largest linear onloaded at the
    frozen dtype (fp32 after k-bit prep) and the compute-dtype copies autocast makes of every linear,
    which autograd keeps for backward (bench/trace/offload.py traces them)."""
    numels = [lin.numel for lin in blk.linears] or [0]
    return max(numels) * st.frozen_bytes + (sum(numels) * st.act_bytes if st.frozen_bytes != st.act_bytes else 0)


def _tally_blocks(st: StackSpec, hw: _dev.Hardware, bbs: list, dmap: dict, exec_dev: str) -> _Tally:
    """Static rows per block's device. Gradients are fp32, one per trainable element, and like the
    adapters they stay in host RAM for a block on disk (trainable tensors cannot live on disk)."""
    t = _Tally(lm_dev=exec_dev)
    comp, counts = t.comp, t.counts
    unquantized = unquantized_blocks(st, dmap, [blk.name for blk, _ in bbs])
    for blk, bb in bbs:
        where = t.placed[blk.name] = dev_name(place(blk.name, dmap))  # where the loader puts it
        on_host = st.embeddings_on_host and hw.has_gpu and bool(blk.embeddings) and not blk.is_layer
        if on_host:
            where = "cpu"  # model/host_embeddings.py: stored and looked up in host RAM, not onloaded
            # loaded on the GPU with the rest, then moved: the load phase holds it there
            t.comp["load_transient"][exec_dev] = max(t.comp["load_transient"][exec_dev], bb.other + bb.buffers)
        compute = where if where.startswith("cuda") or not hw.has_gpu or on_host else exec_dev
        if where == "disk" and not hw.has_gpu:
            compute = "cpu"
        holder = "cpu" if where == "disk" else where
        offloaded = where in OFFLOADED and compute != where
        if blk.name in unquantized:
            _tally_unquantized(st, t, bb, where, offloaded)
        else:
            t.cast_on[holder] = max(t.cast_on[holder], bb.max_cast)
            if where == "disk":  # quant=none: stored as loaded, read in place
                t.disk_read += bb.quant_data + bb.quant_state + bb.other_at_load
                t.disk_max = max(t.disk_max, bb.placed_bytes)
            else:
                comp["quantized_weights"][where] += bb.quant_data + bb.quant_state
                comp["other_params"][where] += bb.other
            # dequant scratch: the largest quantized weight dequantized to the compute dtype (forward
            # and backward of a 4-bit/8-bit linear); DoRA adds its weight-norm temporaries
            t.dequant_on[compute] = max(t.dequant_on[compute], bb.max_dequant * st.act_bytes if st.quantized else 0)
            t.dora_on[compute] = max(t.dora_on[compute], bb.max_dora)
            counts["params_quantized"] += bb.params_quantized
            counts["footprint_at_load"] += bb.quant_data + bb.other_at_load + bb.buffers
            counts["quant_state_bytes"] += bb.quant_state
        comp["buffers"][compute if offloaded else where] += bb.buffers  # accelerate: buffers not offloaded
        if offloaded:
            t.offloaded_max = max(t.offloaded_max, offloaded_working_bytes(st, blk))
        trainable_on = compute if offloaded else holder  # model/loading._adapters_off_meta
        if bb.lora_numel:
            # dpo's init_adapter reference: TRL's frozen copy of the adapter beside it (no gradient, no state)
            copies = 2 if st.reference == "init_adapter" else 1
            comp["lora_weights"][trainable_on] += st.adapter_bytes * bb.lora_numel * copies
            comp["gradients"][trainable_on] += st.adapter_bytes * bb.lora_numel
            t.trainable_shapes[trainable_on] += bb.lora_tensors
        if blk.is_layer:
            t.layers_on[compute].append(bb)
        if blk.name == OUTPUT_HEAD:
            t.lm_dev = compute
        counts["params_total"] += bb.params_total
        counts["lora_params"] += bb.lora_numel
    return t


def _tally_unquantized(st: StackSpec, t: _Tally, bb: BlockBytes, where: str, offloaded: bool) -> None:
    """A block on cpu/disk that the loader keeps unquantized, in the load dtype
    (components.unquantized_bytes). Offloaded (hooked beside a GPU, or on disk) its weights live in
    accelerate's weights map as loaded - a state dict in host RAM, or the checkpoint's tensors read
    from disk - and k-bit prep only retypes the meta parameters; each forward onloads one tensor at
    a time, cast to the parameter's fp32 first (set_module_tensor_to_device: value.to(old dtype),
    then .to(device)), a host-RAM copy for one from RAM. Computing on the CPU (no GPU, disk in
    the map) they are real tensors that k-bit prep upcasts, one at a time."""
    at_load, upcast, placed, largest = unquantized_bytes(st, bb)
    if where == "disk":
        t.disk_read += at_load
        t.disk_max = max(t.disk_max, placed)
    elif offloaded:
        t.comp["other_params"][where] += at_load
        if st.frozen_bytes != dtype_bytes(st.dtype):
            t.host_cast_max = max(t.host_cast_max, largest // dtype_bytes(st.dtype) * st.frozen_bytes)
    else:
        t.comp["other_params"][where] += upcast
        t.cast_on[where] = max(t.cast_on[where], largest)
    t.counts["footprint_at_load"] += at_load + bb.buffers


def _optimizer_rows(st: StackSpec, t: _Tally) -> int:
    """Optimizer state, with its parameters; the optimizer step's scratch (foreach torch AdamW's
    sqrt(exp_avg_sq) temporary, 4 bytes per trainable element; bitsandbytes' step on a CPU, tensor by
    tensor: BNB_CPU_STEP_BYTES per element of the largest). Returns the paged bytes on GPUs."""
    paged_total = 0
    for holder, shapes in t.trainable_shapes.items():
        state, paged = optimizer_bytes(st.optim, shapes)
        t.comp["optimizer_state"][holder] += state + optimizer_shared_bytes(st.optim)
        paged_total += paged if holder.startswith("cuda") else 0
        largest = max((math.prod(s) for s in shapes), default=0)
        if OPTIMIZERS[st.optim] == "adam32_torch":
            t.comp["optimizer_scratch"][holder] += 4 * sum(math.prod(s) for s in shapes)
        elif OPTIMIZERS[st.optim] == "adafactor":
            t.comp["optimizer_scratch"][holder] += 8 * largest
        elif holder == "cpu" and (per := BNB_CPU_STEP_BYTES.get((OPTIMIZERS[st.optim], st.adapter_bytes))):
            t.comp["optimizer_scratch"][holder] += per * largest
    return paged_total


def _activation_rows(st: StackSpec, t: _Tally) -> None:
    """Activations kept for backward and the transients of a step, by the device each layer
    computes on; micro-batch b, sequence s, tokens T = b*s.

    With gradient checkpointing (HF, reentrant or not: transformers wraps each decoder layer in
    torch.utils.checkpoint, which saves only the layer's inputs) every decoder layer keeps its
    input, T*h elements, and one layer at a time recomputes its saved tensors in backward - fp32 in
    a quantized model (unless precision.upcast_frozen=false), because
    prepare_model_for_kbit_training leaves the embeddings in fp32 and bitsandbytes linears return
    their input's dtype, so the residual stream is fp32 (4*T*h bytes, not 2*T*h). Without it each
    layer keeps what autograd saves (components.layer_saved_bytes). The layer working set adds the
    gradient buffers T*(2h + 2f). The loss is TRL's fused LM head (loss.py: tiles, no logits);
    the eval phase is _eval_rows. With trainer.activation_offloading the kept tensors go to host RAM
    (components.offloaded_activations), which then is a device of the plan.
    """
    comp, b = t.comp, st.train_rows
    before = 0  # decoder layers on the devices already tallied (trainer.gradient_checkpointing=N: the first N)
    for dev, layer_bbs in t.layers_on.items():
        if not layer_bbs:
            continue
        cpu = dev == "cpu"
        per_layer, working, partial = _layers_kept(st, layer_bbs, before, b, cpu)
        before += len(layer_bbs)
        stored = sum(per_layer)
        if st.activation_offloading and not cpu:  # TRL: to pinned host RAM but the forward stash
            # a partial N: planned as without checkpointing (every saved tensor of a kept layer moves)
            stored, host = offloaded_activations(replace(st, checkpointing=False) if partial else st, per_layer)
            comp["activations"]["cpu"] += host
        comp["activations"][dev] += stored + shared_per_device_bytes(st, b, cpu)
        comp["activations"][dev] += moe.router_logits_bytes(st, b * st.seq_len, len(layer_bbs), st.act_bytes)
        comp["layer_working"][dev] += working
        comp["dequant_scratch"][dev] += t.dequant_on[dev] + t.dora_on[dev]
    comp["lm_head_loss"][t.lm_dev] += train_loss_bytes(st, b, t.lm_dev == "cpu")
    if st.reference in ("adapter_off", "init_adapter"):  # dpo, kto: the reference's no_grad forward, after the policy's
        for dev in dict.fromkeys([*t.layers_on, t.lm_dev]):
            layer = eval_layer_bytes(st, b, dev == "cpu") + t.dequant_on[dev] if t.layers_on.get(dev) else 0
            head = reference_head_bytes(st, b, dev == "cpu") if dev == t.lm_dev else 0
            comp["reference_forward"][dev] += max(layer, head)
    if st.kl_batch:
        _kl_rows(st, t)
    if st.sample_rows:
        _sampling_rows(st, t)
    if st.evaluates or st.reference == "precomputed":
        _eval_rows(st, t)


def _layers_kept(st: StackSpec, layer_bbs: list, before: int, b: int, cpu: bool) -> tuple[list[int], int, bool]:
    """(bytes each decoder layer of a device keeps for backward, the backward working set beside them,
    whether only some of them are checkpointed). A checkpointed layer keeps its input, T*h elements,
    and recomputes what it saves one layer at a time in backward; the others keep what autograd saves.
    With the first N checkpointed (trainer.gradient_checkpointing=N, model/checkpointing.py) backward
    reaches them last, once the others have freed theirs: the peak is the larger of the start of backward
    (everything kept) and a recompute beside the N inputs."""
    _, r, _ = act_dtypes(st, cpu)
    first = len(layer_bbs) if st.ckpt_layers is None else max(0, min(len(layer_bbs), st.ckpt_layers - before))
    ckpt, kept = (layer_bbs[:first], layer_bbs[first:]) if st.checkpointing else ([], layer_bbs)
    layer_input = b * st.seq_len * st.fig.hidden_size * r
    saved = [layer_saved_bytes(st, x, b, cpu) for x in kept]
    worst = max(layer_bbs, key=lambda x: layer_saved_bytes(st, x, b, cpu))
    backward = backward_working_bytes(st, b, cpu, worst)
    per_layer = [layer_input] * len(ckpt) + saved
    if not ckpt:
        return per_layer, backward, False
    recompute = max(layer_saved_bytes(st, x, b, cpu) for x in ckpt) + backward_working_bytes(st, b, cpu, worst)
    return per_layer, max(backward, recompute - sum(saved)), bool(kept)


def _kl_rows(st: StackSpec, t: _Tally) -> None:
    """KTO's KL batch (TRL 1.16 KTOTrainer._compute_kl_logps): each step first runs the policy under no_grad
    over the micro-batch's prompts paired with their neighbours' completions, before its own forward keeps
    anything: one layer's forward at a time and the fused head's forward tiles, an eval-sized pass of the
    micro-batch. The reference's KL forward runs beside its other one, after the policy's (reference_forward)."""
    for dev in dict.fromkeys([*t.layers_on, t.lm_dev]):
        cpu = dev == "cpu"
        layer = eval_layer_bytes(st, st.train_rows, cpu) + t.dequant_on[dev] if t.layers_on.get(dev) else 0
        head = eval_loss_bytes(st, st.train_rows, cpu) if dev == t.lm_dev else 0
        t.comp["kl_forward"][dev] += max(layer, head)


def _sampling_rows(st: StackSpec, t: _Tally) -> None:
    """grpo: the generation of each step's completions per device (loss.sampling_bytes), a phase of its
    own before the forward; a layer's forward adds the dequantization scratch."""
    for dev in dict.fromkeys([*t.layers_on, t.lm_dev]):
        layers = len(t.layers_on.get(dev, ()))
        here = sampling_bytes(st, layers, dev == t.lm_dev, dev == "cpu")
        t.comp["sampling"][dev] += here + (t.dequant_on.get(dev, 0) if layers else 0)


def _prep_rows(t: _Tally) -> None:
    """prepare_model_for_kbit_training casts each fp16/bf16 tensor that is not 4-bit to fp32, one
    at a time (param.data = param.data.to(float32)): casting the largest, the device holds every
    static row but the adapters, their gradients and optimizer state (made later), plus that
    tensor's load-dtype copy. The excess over the static rows is the k-bit prep phase."""
    comp = t.comp
    for dev, cast in t.cast_on.items():
        later = sum(comp[k].get(dev, 0) for k in ("lora_weights", "gradients", "optimizer_state"))
        if cast > later:
            comp["load_transient"][dev] += cast - later


def _load_rows(st: StackSpec, hw: _dev.Hardware, t: _Tally) -> None:
    """Training on the CPU (no GPU): from_pretrained memory-maps the checkpoint's safetensors files;
    a non-quantized parameter kept in the checkpoint's dtype is a view of the mapping (no copy), and
    every page read stays resident while the mapping lives. The mapping lives as long as one view
    does (bench/results/planner-cpu.json; /proc/self/smaps shows it):
    - k-bit prep upcasts every view to fp32, one at a time: until the last one is cast, the whole
      file is resident beside the quantized weights and the fp32 copies - the load phase, the peak
      of a 300 M+ model on short sequences; then the mapping is gone.
    - without the upcast (quant=none, precision.upcast_frozen=false) the views stay, and so does
      the file for the whole run: a static row, the file's bytes beyond the views' own.
    - a checkpoint stored in another dtype than the load dtype (or stored quantized) leaves no view:
      every tensor is converted as it is read, and the mapping, whole by then, goes when loading ends.
    The file is the checkpoint's own (components.checkpoint_bytes)."""
    if hw.has_gpu or "cpu" not in t.layers_on:
        return
    comp = t.comp
    quantized = sum(comp["quantized_weights"].values())
    file_bytes = checkpoint_bytes(st, t.counts["params_total"], t.counts["params_quantized"], quantized)
    static = sum(comp[k].get("cpu", 0) for k in STATIC)
    if not keeps_views(st):  # converted as read: the file beside what loading has made of it
        at_load = t.counts["footprint_at_load"] + t.counts["quant_state_bytes"]
        comp["load_transient"]["cpu"] = max(comp["load_transient"].get("cpu", 0), file_bytes + at_load - static)
        return
    if st.frozen_bytes == dtype_bytes(st.dtype):  # no upcast: the other params are the file's views
        comp["checkpoint_pages"]["cpu"] += max(0, file_bytes - comp["other_params"].get("cpu", 0))
        return
    held = sum(comp[k].get("cpu", 0) for k in ("quantized_weights", "other_params", "buffers"))
    comp["load_transient"]["cpu"] = max(comp["load_transient"].get("cpu", 0), file_bytes + held - static)


def _eval_rows(st: StackSpec, t: _Tally) -> None:
    """The eval phase per device, the largest of: one layer's forward of an eval batch (no grad),
    the fused head's forward on it (where lm_head computes), and the exact-match metric's generation
    (its KV cache for the layers computing there); a layer's forward adds the dequantization scratch.
    With the load-balancing loss on, TRL asks for the router logits in evaluation too: each layer's,
    from its forward through the loss, beside both forwards."""
    # dpo with precompute_ref_log_probs: the reference's no_grad pass over the train split, before training
    passes = ([st.eval_rows] if st.evaluates else []) + ([st.train_rows] if st.reference == "precomputed" else [])
    for dev in dict.fromkeys([*t.layers_on, t.lm_dev]):
        cpu, layers = dev == "cpu", len(t.layers_on.get(dev, ()))
        dequant = t.dequant_on.get(dev, 0) if layers else 0
        here = [generation_bytes(st, layers, dev == t.lm_dev, cpu) + dequant]
        for rows in passes:
            logits = moe.router_logits_bytes(st, rows * st.seq_len, layers, st.act_bytes)
            if layers:
                here.append(eval_layer_bytes(st, rows, cpu) + dequant + logits)
            if dev == t.lm_dev:
                here.append(eval_loss_bytes(st, rows, cpu) + logits)
        t.comp["eval_transient"][dev] = max(here)


def _device(st: StackSpec, hw: _dev.Hardware, comp: dict, d: str, disk_bytes: int, max_memory: dict | None) -> dict:
    """One device of the plan: its budget, its peak phase and, with a device map, its max_memory."""
    if d == "disk":
        return device_entry(d, _dev.disk_free(st.offload_folder), disk_bytes, "offloaded weights")

    def row(k: str) -> int:
        return comp[k].get(d, 0)

    static, phases, by_phase = phase_peaks(row, d)
    phase = max(by_phase, key=lambda k: by_phase[k])
    comp["allocator_overhead"][d] = int(allocator_bytes(static, phases[phase], d))
    peak = by_phase[phase]
    if not any(phases.values()):
        phase = "static"  # nothing computes here: weights and adapters only
    entry = device_entry(d, hw.gpus[int(d.split(":")[1])] if d.startswith("cuda") else hw.host_ram, peak, phase)
    entry["peak_by_phase"] = by_phase
    entry["peak_allocated"] = allocated_peak(row)
    if max_memory is not None:
        key: Any = int(d.split(":")[1]) if d.startswith("cuda") else "cpu"
        entry["max_memory"] = int(max_memory.get(key, 0))
    return entry


def _notes(
    st: StackSpec, hw: _dev.Hardware, placed: dict[str, str], paged_total: int, disk_read: int, notes: list[str]
) -> None:
    if OPTIMIZERS[st.optim].endswith("_paged") and not hw.has_gpu:
        notes.append("paged optimizers fall back to unpaged on CPU (bitsandbytes): same bytes, no spill")
    if paged_total:
        notes.append(
            f"{paged_total / 2**20:,.0f} MiB of optimizer state is paged (CUDA managed memory): under pressure it "
            "spills to host RAM instead of failing"
        )
    if st.embeddings_on_host and hw.has_gpu:
        notes.append(
            "offload.embeddings: the input embeddings in host RAM, looked up there (only the batch's rows move to "
            "the GPU); loaded on the GPU with the model and moved before training, so the load phase holds them"
        )
    if st.device_map is None and hw.has_gpu and len(hw.gpus) > 1:
        notes.append("offload.device_map null: every data-parallel rank holds a full copy; planned for one rank's GPU")
    if st.quantized and any(v in OFFLOADED for v in placed.values()) and hw.has_gpu:
        notes.append(
            "layers on cpu/disk with a bitsandbytes model need "
            "BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True) (the loader sets it), which keeps them "
            f"unquantized, in {st.dtype} ({dtype_bytes(st.dtype)} B/param, not {_quantized_bytes_word(st)}): host RAM counts them so; "
            "their LoRA adapters, gradients and optimizer state live on the GPU, where the layer computes"
        )
    if disk_read:
        notes.append(
            f"disk: {sum(1 for v in placed.values() if v == 'disk')} module(s), {disk_read / GiB:.1f} GiB in "
            f"{st.dtype}, read from disk at every forward and recompute; "
            + (
                "transformers re-saves converted checkpoint tensors to offload.folder: counted there"
                if rewrites_offloaded(st)
                else "transformers reads them in place from the checkpoint's safetensors files: nothing is written "
                "to offload.folder"
            )
        )
    if not st.quantized:
        notes.append("quant=none: no prepare_model_for_kbit_training, weights stay in the precision dtype")
    if data_note(st):
        notes.append(data_note(st))
    if hw.has_gpu:
        notes.append(
            "loss: TRL's fused LM head, planned for every position of a micro-batch (labels are unknown "
            "here); it scores only positions with a label, so masked prompts and padding need less"
        )


def _quantized_bytes_word(st: StackSpec) -> str:
    return "0.5" if st.quant in ("nf4", "fp4") else "1"


def _plan_dict(
    st: StackSpec,
    hw: _dev.Hardware,
    t: _Tally,
    devices: list[dict],
    dmap: dict,
    max_memory: dict | None,
    paged_total: int,
    notes: list[str],
) -> dict:
    comp, counts = t.comp, t.counts
    gpu_peaks = [x["peak"] for x in devices if x["device"].startswith("cuda")]
    worst = max(gpu_peaks) if gpu_peaks else max(x["peak"] for x in devices if x["device"] == "cpu")
    quantized_bytes = sum(comp["quantized_weights"].values())
    return {
        "version": 1,
        "model": _model_section(st),
        "stack": _stack_section(st, hw),
        "counts": {
            **counts,
            "trainable_params": counts["lora_params"],
            "quantized_bytes_per_param": round(quantized_bytes / counts["params_quantized"], 6)
            if counts["params_quantized"]
            else None,
            "paged_optimizer_bytes": paged_total,
            "disk_read_bytes": t.disk_read,  # disk modules as read in place (load dtype), every forward
        },
        "components": {k: {d: int(v) for d, v in comp[k].items() if v} for k in COMPONENTS if any(comp[k].values())},
        "devices": devices,
        "device_map": {k: v for k, v in dmap.items()},
        "max_memory": {str(k): int(v) for k, v in max_memory.items()} if max_memory else None,
        "fits": all(x["peak"] <= x["budget"] for x in devices),
        "peak_gib": round(worst / GiB, 3),
        "peak_allocated_gib": peak_allocated_gib(devices),
        "tokens_per_step": st.micro_batch * st.seq_len * st.grad_accum * st.world_size,
        "effective_batch": st.micro_batch * st.grad_accum * st.world_size,
        "ladder": [],
        "notes": notes,
        "constants": {
            "cuda_context_bytes": CUDA_CONTEXT_BYTES,
            "cpu_process_baseline_bytes": cpu_process_baseline(),
            "cpu_process_baseline": baseline_source(st.dtype),
            "allocator_static_fraction": ALLOCATOR_STATIC_FRACTION,
            "allocator_dynamic_fraction": ALLOCATOR_DYNAMIC_FRACTION,
            "headroom_target": HEADROOM_TARGET,
        },
    }


def _model_section(st: StackSpec) -> dict:
    fig = st.fig
    return {
        "name_or_path": st.name_or_path,
        "architecture": fig.architecture,
        "figures_from": fig.source,
        "hidden_size": fig.hidden_size,
        "num_layers": fig.num_layers,
        "num_heads": fig.num_heads,
        "num_kv_heads": fig.num_kv_heads,
        "head_dim": fig.head_dim,
        "intermediate_size": fig.intermediate_size,
        "vocab_size": fig.vocab_size,
        "tie_embeddings": fig.tie_embeddings,
    }


def _stack_section(st: StackSpec, hw: _dev.Hardware) -> dict:
    return {
        "quant": st.quant + ("+dq" if st.quantized and st.quant != "int8" and st.double_quant else ""),
        "peft": st.peft,
        "r": st.r,
        "alpha": st.alpha,
        "target_modules": list(st.target_modules) if isinstance(st.target_modules, tuple) else st.target_modules,
        "optim": st.optim,
        "dtype": st.dtype,
        "micro_batch_size": st.micro_batch,
        "grad_accum": st.grad_accum,
        "eval_batch_size": st.eval_batch if st.evaluates else None,
        "seq_len": st.seq_len,
        "gradient_checkpointing": st.checkpointing if st.ckpt_layers is None else st.ckpt_layers,
        "attention": "eager" if eager(st) else st.attn,
        **({"eager_scores_bytes": eager_scores_bytes(st, st.micro_batch)} if eager(st) else {}),
        "device_map": st.device_map,
        "world_size": st.world_size,
        **({"adapter_dtype": "bfloat16"} if st.adapter_bytes == 2 else {}),
        "hardware": {"gpus": list(hw.gpus), "host_ram": hw.host_ram, "declared": hw.declared},
    }
