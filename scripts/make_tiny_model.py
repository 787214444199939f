"""Build the tiny default base model: a 2-layer Llama with a character tokenizer, pretrained on CPU.

A randomly initialised base cannot show a fine-tune learning anything in a minute, so the base is
pretrained once (full-parameter, fp32, ~2 min on 2 cores) on terse string skills:
`copy: s`, `sort: s`, `first: s`, `last: s`, `min: s`, `max: s`. The shipped sample fine-tune
(scripts/make_sample_data.py) then teaches it a new instruction, which is what a user's QLoRA
fine-tune of a real base does. Seeded; the result is committed under assets/tiny-llama.

    python scripts/make_tiny_model.py [--out assets/tiny-llama] [--steps 1500]
"""

import argparse
import random
import time
from pathlib import Path

SKILLS = {
    "copy": lambda s: s,
    "sort": lambda s: "".join(sorted(s)),
    "first": lambda s: s[0],
    "last": lambda s: s[-1],
    "min": min,
    "max": max,
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
# A plain role-prefixed template; {% generation %} marks what TRL's assistant_only_loss trains on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}assistant: {% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one token
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build(out: Path, steps: int, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.05)

    def example():
        skill = rng.choice(list(SKILLS))
        s = "".join(rng.sample(LETTERS, rng.randint(3, 6)))
        prompt = tokenizer(f"{skill}: {s}\n")["input_ids"]
        answer = tokenizer(SKILLS[skill](s), add_special_tokens=False)["input_ids"] + [2]
        return prompt + answer, [-100] * len(prompt) + answer

    start = time.time()
    for step in range(steps):
        batch = [example() for _ in range(64)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        loss = model(input_ids=ids, attention_mask=(ids != 0).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 250 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "tiny-llama")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out, args.steps, args.seed)


if __name__ == "__main__":
    main()
