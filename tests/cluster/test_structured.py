"""Structured outputs: a JSON schema, a regular expression or a Lark grammar constrains the
output token by token, exactly under speculation (greedy output equals plain constrained
decoding, drafts accepted and rejected), over gRPC and the OpenAI API; a grammar that cannot
be used is refused by name, quickly."""

from __future__ import annotations

import json
import re
import time

import grpc
import jsonschema
import llguidance.torch
import pytest
import torch
from openai import BadRequestError

from helpers import generate, request
from specserve.engine.flat_model import FlatModel
from specserve.speculation import grammar
from specserve.speculation.draft_model import DraftModelProposer
from specserve.speculation.grammar import apply_masks as apply
from specserve.speculation.proposer import DraftJob, TreeShape
from specserve.speculation.tree import DraftTree
from specserve.v1 import common_pb2
from specserve.verifier.constraint import Constraint

OFF = common_pb2.SpeculationOptions(mode=common_pb2.SPECULATION_MODE_OFF)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "admin": {"type": "boolean"},
        "role": {"enum": ["owner", "reader", "writer"]},
    },
    "required": ["name", "admin", "role"],
    "additionalProperties": False,
}


def constrained_greedy(model, grammars, text: str, prompt: list[int], n: int, eos: set[int]):
    """Plain constrained decoding, as a user would write it with HF and llguidance: the
    whole forward each token, its logits masked, the argmax; ends at EOS, when the grammar
    is complete, or after n tokens."""
    matcher, out = grammars.matcher(text), []
    mask = llguidance.torch.allocate_token_bitmask(1, grammars.vocab_size)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1:].float()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        apply(logits, mask)
        token = int(logits.argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if token in eos or matcher.is_stopped():
            break
    return out


def test_masks_follow_each_path_of_a_tree(tokenizer):
    """Row 0 at the state, row i + 1 after node i's path; a node the grammar rules out is
    cut, with its subtree, from a deterministic tree."""
    grammars = grammar.Grammars(tokenizer, len(tokenizer))
    text = grammar.source(common_pb2.Grammar(regex="(ab|ac)d"))
    a, b, c, d = (tokenizer.convert_tokens_to_ids(t) for t in "abcd")
    constraint = Constraint(grammars.matcher(text), grammars.vocab_size, {tokenizer.eos_token_id})
    tree = DraftTree([a, b, d, c, d, b], [-1, 0, 0, 1, 1, 4])  # a -> b -> d, a -> d, ...
    masks, legal = constraint.masks(tree)
    assert legal == [True, True, False, False, True, False]
    logits = torch.zeros(len(tree) + 1, grammars.vocab_size)
    apply(logits, masks)
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert {a}.issubset(allowed[0]) and b not in allowed[0]  # "a" starts every string
    assert {b, c}.issubset(allowed[1]) and d not in allowed[1]  # after "a"
    assert d in allowed[2] and a not in allowed[2]  # after "ab"
    assert constraint.consumed == 0  # the walk leaves the matcher where it stood
    pruned = constraint.prune(tree)
    assert pruned.token_ids == [a, b, d] and pruned.parents == [-1, 0, 1]
    # An end of sequence in a tree, where the grammar may end: allowed, and the walk leaves
    # the matcher where it stood (llguidance does not roll an end of sequence back).
    eos = tokenizer.eos_token_id
    constraint.consume(a)
    masks, legal = constraint.masks(DraftTree([b, d, eos], [-1, 0, 1]))
    assert legal == [True, True, True] and constraint.consumed == 1
    for token in (b, d, eos):
        constraint.consume(token)
    assert constraint.complete


def allowed_after(grammars, text: str, path: list[int]) -> torch.Tensor:
    """[vocab] bool: what the grammar allows after `path`."""
    follower = grammar.Follower(grammars.matcher(text), grammars.tokenizer.eos_tokens)
    assert follower.follow(path)
    masks = llguidance.torch.allocate_token_bitmask(1, grammars.vocab_size)
    follower.fill([], masks, 0)
    row = torch.zeros(1, grammars.vocab_size)
    apply(row, masks)
    return torch.isfinite(row[0])


@pytest.mark.parametrize(
    "temperature,branching", [(0.0, 2), (0.0, 1), (1.0, 2)], ids=["greedy", "chain", "sampled"]
)
def test_the_draft_model_drafts_only_what_the_grammar_allows(
    tokenizer, tiny_draft, temperature, branching
):
    """Every node of the draft model's trees, and every token of the draft distributions it
    drew from, is what the grammar allows after the node's path; the same model without the
    grammar drafts what it does not (so the check can fail)."""
    grammars = grammar.Grammars(tokenizer, tiny_draft.config.vocab_size)
    text = grammar.source(common_pb2.Grammar(json_schema=json.dumps(PERSON)))
    prompt = tokenizer("import numpy as np\n").input_ids
    shape = TreeShape(max_depth=6, branching=branching, width=4)
    guided = DraftModelProposer(FlatModel(tiny_draft), shape, grammars=grammars)
    free = DraftModelProposer(FlatModel(tiny_draft), shape)

    def legal(tree: DraftTree, output: list[int]) -> bool:
        dead = set()  # (a sampled tree's fixed shape: nodes q gave nothing, never accepted)
        for node, (token, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
            ids, probs = tree.dists.get(parent, ([token], [1.0]))
            if parent in dead or probs[ids.index(token)] == 0:
                dead.add(node)
            elif not allowed_after(grammars, text, output + tree.path(node)[:-1])[token]:
                return False
        for node, (ids, probs) in tree.dists.items():  # (sampled: q's support)
            if node in dead:
                continue
            ok = allowed_after(grammars, text, output + (tree.path(node) if node >= 0 else []))
            if any(p > 0 and not ok[t] for t, p in zip(ids, probs, strict=True)):
                return False
        return True

    output: list[int] = []
    illegal = 0
    for step in range(4):  # the output grows by a token the grammar allows
        job = DraftJob(
            "s", prompt + output, 12, temperature, seed=step, grammar=text, prompt_len=len(prompt)
        )
        tree = guided.propose([job])[0]
        assert len(tree) and legal(tree, output)
        illegal += not legal(free.propose([job])[0], output)
        output.append(int(allowed_after(grammars, text, output).nonzero()[0]))
    assert illegal


@pytest.mark.cluster
@pytest.mark.parametrize(
    "field",
    [{"json_schema": json.dumps(PERSON)}, {"regex": r"[a-z]{2,6}@(alpha|beta)\.org"}],
    ids=["json-schema", "regex"],
)
def test_greedy_constrained_output_is_plain_constrained_decodings(
    drafting_stub, tokenizer, tiny_model, field
):
    prompt = tokenizer("import numpy as np\n").input_ids
    spec = common_pb2.Grammar(**field)
    on = generate(drafting_stub, request(prompt, max_tokens=48, grammar=spec))
    off = generate(drafting_stub, request(prompt, max_tokens=48, grammar=spec, speculation=OFF))
    grammars = grammar.Grammars(tokenizer, tiny_model.config.vocab_size)
    eos = {tokenizer.eos_token_id}
    expected = constrained_greedy(tiny_model, grammars, grammar.source(spec), prompt, 48, eos)
    assert on.ids == off.ids == expected
    assert on.final.speculation.drafted_tokens > 0
    assert on.final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_EOS)
    if "json_schema" in field:
        jsonschema.validate(json.loads(on.text), PERSON)
    else:
        assert re.fullmatch(field["regex"], on.text)


@pytest.mark.cluster
def test_sampled_outputs_always_match_the_schema(drafting_stub, tokenizer):
    spec = common_pb2.Grammar(json_schema=json.dumps(PERSON))
    prompt = tokenizer("x = 1\n").input_ids
    for seed in range(4):
        sampling = common_pb2.SamplingParams(temperature=1.0, seed=seed)
        result = generate(
            drafting_stub, request(prompt, max_tokens=48, grammar=spec, sampling=sampling)
        )
        assert result.final.finish_reason != common_pb2.FINISH_REASON_LENGTH, result.text
        jsonschema.validate(json.loads(result.text), PERSON)


@pytest.mark.cluster
def test_forced_tokens_are_drafted_for_free(drafting_stub, tokenizer):
    """A schema whose keys and punctuation the grammar forces: those tokens come as the
    step's draft, so steps take more than one token even with speculation pinned to a tree
    the draft model cannot fill well."""
    schema = {
        "type": "object",
        "properties": {
            "identifier": {"type": "boolean"},
            "description": {"enum": ["brief", "detailed"]},
        },
        "required": ["identifier", "description"],
        "additionalProperties": False,
    }
    spec = common_pb2.Grammar(json_schema=json.dumps(schema))
    result = generate(
        drafting_stub, request(tokenizer("SELECT").input_ids, max_tokens=40, grammar=spec)
    )
    json.loads(result.text)
    stats = result.final.speculation
    assert stats.accepted_tokens > 0 and stats.mean_accepted_length > 1.5


@pytest.mark.cluster
@pytest.mark.parametrize("speculation", ["on", "off"])
def test_the_openai_client_gets_json_that_validates(drafting_api, speculation):
    model = drafting_api.models.list().data[0].id
    extra = {} if speculation == "on" else {"extra_body": {"speculation": "off"}}
    for temperature in (0, 1.0):
        reply = drafting_api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a user as JSON."}],
            max_tokens=64,
            temperature=temperature,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            **extra,
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    anything = drafting_api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Any JSON object."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = {
    "unsatisfiable": {"type": "string", "minLength": 5, "maxLength": 2},
    "dangling-ref": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
    "huge": {"enum": ["v" * 40 + str(i) for i in range(2_000)]},  # (past 64 KiB)
    "10000-enum": {"enum": list(range(10_000))},
    "nested-50": nested(50),
    "no-base-case": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "endless": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "not-a-schema": [1, 2],
}


@pytest.mark.cluster
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_schema_that_cannot_be_used_is_refused_quickly_by_name(drafting_api, drafting_stub, name):
    started = time.monotonic()
    with pytest.raises(BadRequestError) as refused:
        drafting_api.chat.completions.create(
            model=drafting_api.models.list().data[0].id,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": HOSTILE[name]},
            },
        )
    assert refused.value.body["param"] == "response_format"
    assert time.monotonic() - started < 10
    with pytest.raises(grpc.RpcError) as grpc_refused:
        spec = common_pb2.Grammar(json_schema=json.dumps(HOSTILE[name]))
        generate(drafting_stub, request([1, 2], max_tokens=4, grammar=spec))
    assert grpc_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_refused.value.details().startswith("grammar: ")
    # The gateway still serves.
    assert generate(drafting_stub, request([1, 2], max_tokens=2)).ids


@pytest.mark.cluster
def test_an_output_cut_short_ends_with_length_not_as_a_finished_answer(drafting_stub):
    """A schema whose shortest output is longer than max_tokens allows: the output is a
    prefix of one, and its finish reason says it was cut."""
    spec = common_pb2.Grammar(json_schema=json.dumps({"type": "string", "minLength": 200}))
    result = generate(drafting_stub, request([1, 2, 3], max_tokens=8, grammar=spec))
    assert result.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(result.ids) == 8 and result.text.startswith('"')
