"""A packed padding-free batch (BFD, position_ids restarting per row) computes the logits and the loss
its rows give one by one, through our data path, TRL's collator and the attention auto picks, on the
tiny model in NF4. Tolerance: fp32 on a CPU, 1e-4 on logits (float sums in another order), 1e-5
relative on the loss."""

from itertools import pairwise

import pytest
import torch
from conftest import SMOKE, compose_cfg

from qlora_recipes import data
from qlora_recipes.config.attention import VARLEN
from qlora_recipes.model import loading
from qlora_recipes.run import trainer_args

PACKED = (*SMOKE, "data.packing=true", "data.packing_strategy=bfd", "trainer.micro_batch_size=4", "trainer.seq_len=96")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(model, first packed training batch, its logits and loss) as SFTTrainer computes them."""
    from trl import SFTTrainer

    cfg = compose_cfg(*PACKED)
    run_dir = tmp_path_factory.mktemp("run")
    tokenizer = loading.load_tokenizer(cfg.model)
    train_ds, _, stats = data.load_splits(cfg.data, tokenizer, cfg.trainer.seq_len, cfg.seed, cfg.objective)
    model = loading.make_trainable(cfg, loading.load_model(cfg, run_dir))
    model.eval()  # no LoRA dropout: the two passes must see the same function
    args = trainer_args.trainer_config(cfg, run_dir, stats["format"], False, False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_ds, processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss, out = trainer.compute_loss(model, dict(batch), return_outputs=True)
    return cfg, model, batch, out.logits, loss


def test_auto_trains_packed_rows_on_the_varlen_path_in_nf4(packed):
    cfg, model, batch, _, _ = packed
    assert cfg.model.attn_implementation == VARLEN and model.config._attn_implementation == VARLEN
    assert "Linear4bit" in {type(m).__name__ for m in model.modules()}
    bounds = batch["cu_seq_lens_q"].tolist()
    assert batch["input_ids"].shape[0] == 1 and len(bounds) > 3  # several rows in one flat row
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == bounds[:-1]  # position_ids restart at each row


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_and_loss_equal_the_rows_run_one_by_one(packed, attention):
    """Each row alone through transformers' own sdpa / eager attention (no packing anywhere)."""
    _, model, batch, logits, loss = packed
    bounds = batch["cu_seq_lens_q"].tolist()
    model.get_base_model().set_attn_implementation(attention)
    try:
        rows, losses, counted = [], 0.0, 0
        with torch.no_grad():
            for start, end in pairwise(bounds):
                row = model(input_ids=batch["input_ids"][:, start:end], use_cache=False).logits
                labels = batch["labels"][0, start:end]
                shifted, targets = row[0, :-1], labels[1:]
                kept = targets != -100
                losses += torch.nn.functional.cross_entropy(shifted[kept], targets[kept], reduction="sum").item()
                counted += int(kept.sum())
                rows.append(row)
    finally:
        model.get_base_model().set_attn_implementation(VARLEN)
    unpacked = torch.cat(rows, dim=1)
    assert torch.allclose(logits, unpacked, atol=1e-4, rtol=0), (logits - unpacked).abs().max()
    assert loss.item() == pytest.approx(losses / counted, rel=1e-5)


def test_varlen_builds_no_dense_mask_where_sdpa_builds_one(packed):
    """transformers' mask for the flat row: sdpa's is [1, 1, n, n]; sdpa_varlen's is none at all."""
    from transformers.masking_utils import create_causal_mask

    _, model, batch, _, _ = packed
    config = model.get_base_model().config
    n = batch["input_ids"].shape[1]
    embeds = torch.zeros(1, n, config.hidden_size)
    masks = {}
    for attention in ("sdpa", VARLEN):
        config._attn_implementation = attention
        masks[attention] = create_causal_mask(
            config=config,
            inputs_embeds=embeds,
            attention_mask=None,
            past_key_values=None,
            position_ids=batch["position_ids"],
        )
    assert tuple(masks["sdpa"].shape) == (1, 1, n, n) and masks[VARLEN] is None


def test_a_sliding_window_holds_inside_each_packed_sequence():
    """Mistral with a window shorter than its sequences: sdpa_varlen's packed row equals transformers'
    sdpa on each row alone (which masks the window itself)."""
    from transformers import MistralConfig, MistralForCausalLM

    from qlora_recipes.model.packed_attention import register

    register()
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=128,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    lens = [30, 5, 21]
    ids = torch.randint(3, 100, (1, sum(lens)))
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in pairwise(bounds)], 1)
        model.set_attn_implementation(VARLEN)
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert torch.allclose(packed, alone, atol=1e-5, rtol=0), (packed - alone).abs().max()
