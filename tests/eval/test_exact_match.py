"""Greedy exact match without generating equals what generate() produces: for a dense model
and for a sequence-routed MoE (which routes on the prompt, as in generation), the model's own
greedy continuation matches and any changed token does not."""

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.eval.exact_match import (
    answer_ids,
    code_items,
    completion_cut,
    greedy_continues,
    math_items,
)
from moemerge.toy.corpora import domain_text

NEW = 6


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    base = model_factory("llama")
    experts = [perturbed_copy(base, root / f"s{i}", scale=0.3, seed=20 + i, only="layers.")
               for i in range(2)]
    recipe = ("kind: moe\nassembly: seq_routed\nexperts: [" + ", ".join(map(str, experts))
              + f"]\nbase_model: {base}\nrouter: {{kind: perplexity}}\n")
    build(write_recipe(root / "seq.yaml", recipe), root / "seq", progress=False)
    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                        trust_remote_code=True).eval()
            for name, path in (("dense", base), ("seq_routed", root / "seq"))}


@pytest.mark.parametrize("name", ["dense", "seq_routed"])
def test_matches_generate(models, name):
    model = models[name]
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        head = torch.randint(4, 256, (int(torch.randint(3, 12, (1,), generator=gen)),),
                             generator=gen).tolist()
        out = model.generate(torch.tensor([head]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
        tail = out[0, len(head):].tolist()
        assert greedy_continues(model, head, tail)
        assert greedy_continues(model, head, tail[:1])  # a one-token answer: no second forward
        # `then` checks the token after the answer: the one greedy decoding produced, or not
        assert greedy_continues(model, head, tail[:3], then=lambda t, n=tail[3]: t == n)
        assert not greedy_continues(model, head, tail[:3], then=lambda t, n=tail[3]: t != n)
        for i in (0, NEW - 1):  # the comparison can fail: any token changed
            wrong = tail.copy()
            wrong[i] = (wrong[i] + 1) % 256
            assert not greedy_continues(model, head, wrong)


def test_answer_ids_keep_a_boundary_token_whole(tokenizer):
    prompt, answer = "return a + b", "cde\n"
    head, tail = answer_ids(tokenizer, prompt, answer)
    assert tokenizer.decode(head + tail) == prompt + answer
    assert head == tokenizer(prompt, add_special_tokens=False)["input_ids"][:len(head)]


def test_items_from_the_corpora(tokenizer):
    items = math_items(domain_text("math", 20_000, split="eval"), 40)
    assert len(items) == 40
    for prompt, value in items:
        line = prompt.rsplit("\n", 1)[-1]
        assert line.startswith("Q: ") and prompt.endswith(" = ") and value.endswith(".")
        assert " = " not in value  # the final value only
    code = code_items(domain_text("code", 40_000, split="eval"), tokenizer, 20, context=32)
    assert len(code) == 20
    for prompt, rest in code:  # the prompt ends inside the line that the answer completes
        line = prompt.rsplit("\n", 1)[-1] + rest
        assert "\n" not in rest and rest.strip() and len(line.strip()) >= 12


def test_completion_cut():
    assert completion_cut("    return a + b") == len("    return ")
    assert completion_cut("    self.assertEqual(f(1), 2)") == len("    self.")
    assert completion_cut("        x") == len("        ")  # one word: after the indent
    assert completion_cut("abcdefgh ij") == 0
