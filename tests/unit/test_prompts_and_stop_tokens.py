"""Prompts for generation are rendered as the run's data was (alpaca, chat, prompt/completion), and
generation stops at every end-of-sequence id and the chat template's end of turn."""

import json

import torch
from conftest import compose_cfg


def test_prompts_are_rendered_as_the_run_data_was(tmp_path):
    from transformers import AutoTokenizer

    from qlora_recipes.data import alpaca_prompt
    from qlora_recipes.outputs.prompts import Prompt, read_prompts, render

    tokenizer = AutoTokenizer.from_pretrained(compose_cfg().model.name_or_path)
    text, special = render(tokenizer, Prompt("text", "hi"), "chat")
    assert text == "<s>user: hi\nassistant: " and special is False
    assert render(tokenizer, Prompt("text", "hi"), "alpaca") == (alpaca_prompt("hi"), True)
    assert render(tokenizer, Prompt("text", "hi"), "plain") == ("hi", True)

    rows = tmp_path / "p.jsonl"
    rows.write_text(
        '"plain"\n{"prompt": "order: ab\\n", "completion": "ab"}\n'
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
        '{"instruction": "do", "output": "x"}\n'
    )
    got = read_prompts(rows)
    assert [p.kind for p in got] == ["text", "formatted", "messages", "formatted"]
    assert got[1].value == "order: ab\n" and got[2].value == [{"role": "user", "content": "q"}]
    assert got[3].value == alpaca_prompt("do")


def test_prompt_formats_of_alpaca_and_chat_runs(tmp_path):
    from transformers import AutoTokenizer

    from qlora_recipes.data import alpaca_prompt
    from qlora_recipes.outputs.prompts import Prompt, PromptFormat, load_prompt_format, render

    tokenizer = AutoTokenizer.from_pretrained(compose_cfg().model.name_or_path)
    chat = PromptFormat(style="chat", system="be brief")
    assert render(tokenizer, Prompt("text", "hi"), chat) == ("<s>system: be brief\nuser: hi\nassistant: ", False)
    assert render(tokenizer, Prompt("text", "hi"), {"style": "alpaca"}) == (alpaca_prompt("hi"), True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"data": {"prompt_format": {"style": "chat", "system": "s"}}}))
    assert load_prompt_format(run, "chat") == PromptFormat(style="chat", system="s")
    assert load_prompt_format(run, "plain") == PromptFormat(style="plain")  # --no-chat
    assert load_prompt_format(tmp_path / "nothing", "alpaca") == PromptFormat(style="alpaca")


def _tiny_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = compose_cfg().model.name_or_path
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_generation_stops_at_every_eos_id_of_the_generation_config():
    """Regression: generation used to pass eos_token_id=tokenizer.eos_token_id, replacing the model's
    generation_config list (Llama 3 [128001, 128009], Gemma [1, 107]). A tiny model whose
    generation_config lists two eos ids stops at the second one."""
    from qlora_recipes.outputs.generation import generate, stop_token_ids
    from qlora_recipes.outputs.prompts import Prompt

    model, tokenizer = _tiny_model()
    prompt = [Prompt("formatted", "copy: qwerty\n")]
    free = generate(model, tokenizer, prompt, "plain", 12)[0]
    assert len(free) >= 6 and len(set(free[:4])) == 4, free  # the base copies the letters
    second = tokenizer.convert_tokens_to_ids(free[3])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, second]
    assert stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id, second]
    stopped = generate(model, tokenizer, prompt, "plain", 12)[0]
    assert stopped == free[:4]  # up to and including the second eos id, not a token further

    # batched, greedy or sampled: every row stops there
    stopped = generate(model, tokenizer, prompt * 3, "plain", 12, batch_size=3)
    assert stopped == [free[:4]] * 3

    # the exact-match metric generates through the same loop: the model's own stop list decides
    from qlora_recipes.run import metrics

    pairs = [("copy: qwerty\n", free[:4])]
    assert metrics.exact_match(model, tokenizer, pairs, 12) == 1.0
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # the tokenizer's EOS alone
    assert metrics.exact_match(model, tokenizer, pairs, 12) == 0.0


def test_stop_tokens_are_the_union_with_the_chat_end_of_turn():
    from qlora_recipes.data.chat import CHATML
    from qlora_recipes.outputs.generation import stop_strings, stop_token_ids
    from qlora_recipes.outputs.prompts import PromptFormat

    model, tokenizer = _tiny_model()
    model.generation_config.eos_token_id = [2, 7]
    tokenizer.chat_template = CHATML
    chat = PromptFormat(style="chat")
    # <|im_end|> is not a token of this tokenizer: stop on its text
    assert stop_token_ids(model, tokenizer) == [2, 7] and stop_strings(tokenizer, chat) == ["<|im_end|>"]
    assert stop_strings(tokenizer, PromptFormat()) == []
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(model, tokenizer) == [2, 7, end] and stop_strings(tokenizer, chat) == []
