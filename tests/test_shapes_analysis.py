"""The analysis on synthetic records: variation, per-step comparison, causes, verdicts."""

from __future__ import annotations

from collections import Counter

from torchaxe.runtime.profile import InputSignature, Profile, RunInfo, ShapeReport, ShapeTally
from torchaxe.shapes.analysis import analyse, explains, op_subject, variations
from torchaxe.shapes.observe import Observation
from torchaxe.shapes.recorder import DataDependentSite, LoaderInfo, OpTally
from torchaxe.shapes.verdict import decide


def tally(name, steps):
    """An OpTally from {step: [signature, ...]}."""
    op = OpTally(name)
    for step, signatures in steps.items():
        for sig in signatures:
            op.add(sig, step)
    return op


def test_explains_allows_a_multiplier_and_a_small_offset():
    assert explains({16 * 63, 4 * 63}, {16, 4})  # batch x fixed length, flattened
    assert explains({61, 63}, {62, 64})  # next-token targets: length - 1
    assert not explains({7, 13}, {16, 4})
    assert not explains({16}, {16, 4})  # one size does not vary


def test_variations_names_the_varying_dimensions():
    rank_varies, dims = variations(Counter({((4, 10), (4,)): 3, ((4, 12), (4,)): 1}))
    assert not rank_varies
    assert [(d.position, d.dim, dict(d.values)) for d in dims] == [("input 0", 1, {10: 3, 12: 1})]
    rank_varies, dims = variations(Counter({(((2,), (2,)),): 1, (((2,), (2,), (2,)),): 1}))
    assert rank_varies and [(d.position, d.dim) for d in dims] == [("input 0", None)]


def test_an_op_called_at_several_places_is_static_when_each_step_repeats():
    layers = [((4, 8), (8, 8)), ((4, 8), (8, 2))]
    op = tally("aten.mm.default", {1: layers + [((1, 1), (1, 1))], 2: layers, 3: layers, 4: layers + layers})
    subject = op_subject(op, complete_steps=4)
    assert not subject.dynamic and subject.distinct == 1  # step 1's one-off call and a repeat do not count


def test_an_op_whose_shapes_change_between_steps_is_dynamic():
    op = tally("aten.mm.default", {s: [((4, 8), (8, 8)), ((4 * (s + 10), 8), (8, 8))] for s in range(1, 9)})
    subject = op_subject(op, complete_steps=8)
    assert subject.dynamic and subject.distinct == 7
    assert [(d.position, d.dim, d.distinct) for d in subject.dims] == [("input 0", 0, 7)]
    assert subject.late  # new sizes until the end


def profile_with_modules(modules=()):
    return Profile(status="stopped", run=RunInfo(command=["python", "t.py"], target="cpu"),
                   shapes=ShapeReport(modules=list(modules)))


def observation(ops, loaders=(), sites=(), steps=8):
    obs = Observation(profile=profile_with_modules(), ops=list(ops), sites=list(sites), loaders=list(loaders),
                      complete_steps=steps)
    obs.profile.steps = []  # the step count comes from the records here
    return obs


def test_collate_cause_bucketing_and_dynamic_verdict():
    lengths = [40, 57, 64, 33, 61, 45, 64, 52]
    loader = LoaderInfo(collate="pad_collate", collate_location="t.py:9", batch_size=8, drop_last=True,
                        dataset_length=64, batches=[((8, t), (8,)) for t in lengths])
    op = tally("aten.embedding.default", {s: [((100, 16), (8, t))] for s, t in enumerate(lengths, 1)})
    analysis = analyse(observation([op], [loader]))
    collate = next(c for c in analysis.causes if c.kind == "collate")
    emb = next(s for s in analysis.subjects if s.kind == "op")
    assert emb.dims[0].cause == collate.id and collate.location == "t.py:9"
    verdict = decide(analysis, max_shapes=3)
    assert verdict.verdict == "dynamic"
    assert verdict.buckets and verdict.buckets[0].chosen.shapes <= 3 and verdict.buckets[0].dims == (1,)
    assert verdict.picks == {"npu": "jit-compile-on+bucketing", "cuda": "compile-static+bucketing",
                             "cpu": "compile-static+bucketing"}
    kinds = {(r.target, r.kind) for r in verdict.recommendations}
    assert {("npu", "compile-mode"), ("cpu", "compile"), ("cuda", "mark-dynamic"), ("cpu", "bucketing")} <= kinds
    npu = next(r for r in verdict.recommendations if r.target == "npu" and r.kind == "compile-mode")
    assert "jit_compile=False" in npu.setting and npu.unverified_on_hardware


def test_sequence_first_batches_vary_in_length_not_in_batch_size():
    # A review's translation script: pad_sequence without batch_first gives (length, 64)
    # batches; the varying length was taken for "the batch size varies: 31 to 32".
    lengths = [31, 32, 32, 31, 32, 31]
    loader = LoaderInfo(collate="collate_fn", collate_location="t.py:32", batch_size=64, drop_last=False,
                        dataset_length=6400, batches=[((t, 64), (t + 1, 64)) for t in lengths])
    op = tally("aten.embedding.default", {s: [((100, 16), (t, 64))] for s, t in enumerate(lengths, 1)})
    analysis = analyse(observation([op], [loader]))
    assert not [c for c in analysis.causes if c.kind == "batch-size"]
    collate = [c for c in analysis.causes if c.kind == "collate"]
    assert len(collate) == 2 and all("dimension 0 (sequence-first batches: dimension 1 holds the batch of 64)"
                                     in c.message for c in collate)


def test_partial_batch_only_is_static_with_drop_last():
    # The same verdict whether or not the steps watched reach the epoch's end (a review
    # saw "mixed" for a 13-batch epoch and "static" for a 63-batch one, same script).
    batches = [((4, 6),)] * 3 + [((2, 6),)] + [((4, 6),)] * 3 + [((2, 6),)]
    loader = LoaderInfo(collate="torch.utils.data.default_collate", collate_location=None, batch_size=4,
                        drop_last=False, dataset_length=14, batches=batches)
    op = tally("aten.addmm.default", {s: [((3,), (b[0][0], 6), (6, 3))] for s, b in enumerate(batches, 1)})
    analysis = analyse(observation([op], [loader]))
    cause = next(c for c in analysis.causes if c.kind == "partial-batch")
    assert "14 samples in batches of 4 leave 2" in cause.message
    verdict = decide(analysis)
    assert verdict.verdict == "static" and verdict.picks["cpu"] == "compile-static"
    assert verdict.reasons[0].startswith("static but for the epoch's last, smaller batch")
    cpu = next(r for r in verdict.recommendations if r.target == "cpu" and r.kind == "compile")
    assert cpu.setting == "model = torch.compile(model, dynamic=False)" and "drop_last=True avoids it" in cpu.reason
    assert any(r.kind == "drop-last" and "drop_last=True" in r.setting for r in verdict.recommendations)


def test_a_smaller_last_batch_after_the_steps_watched_is_said_with_the_static_verdict():
    """Five steps of a 63-batch epoch all had 16 samples; the epoch's last has 8
    (1000 samples, drop_last=False): still static, but compiled code compiles once
    more for it, and drop_last=True avoids that."""
    batches = [((16, 3),)] * 5
    loader = LoaderInfo(collate="torch.utils.data.default_collate", collate_location=None, batch_size=16,
                        drop_last=False, dataset_length=1000, batches=batches)
    op = tally("aten.mm.default", {s: [((16, 3), (3, 3))] for s in range(1, 6)})
    verdict = decide(analyse(observation([op], [loader], steps=5)))
    assert verdict.verdict == "static" and verdict.picks["cpu"] == "compile-static"
    assert any("the last batch of each epoch has 8 samples, not 16" in r and "drop_last=True" in r
               for r in verdict.reasons)
    cpu = next(r for r in verdict.recommendations if r.target == "cpu" and r.kind == "compile")
    assert "compiled once more for that batch" in cpu.reason and cpu.setting.endswith("dynamic=False)")
    # drop_last=True, or a dataset the batch size divides: nothing to say.
    even = LoaderInfo(collate="torch.utils.data.default_collate", collate_location=None, batch_size=16,
                      drop_last=False, dataset_length=992, batches=batches)
    assert not any("last batch" in r for r in decide(analyse(observation([op], [even], steps=5))).reasons)
    # A job of 40 steps (its command says --max_iters 40) never reaches batch 63: nor then.
    short = decide(analyse(observation([op], [loader], steps=5)), job_batches=40)
    assert not any("last batch" in r for r in short.reasons)
    assert "dynamic=False" not in next(r for r in short.recommendations if r.target == "cpu"
                                       and r.kind == "compile").setting
    assert any("last batch" in r for r in decide(analyse(observation([op], [loader], steps=5)),
                                                job_batches=63).reasons)


def test_boolean_mask_sizes_make_it_dynamic_with_the_line():
    site = DataDependentSite(kind="boolean-mask", op="aten.index.Tensor", location="t.py:12", code="x[mask]",
                             calls=6, sizes=Counter({3: 2, 5: 2, 7: 2}))
    op = tally("aten.relu.default", {s: [((n, 4),)] for s, n in enumerate([3, 5, 7, 3, 5, 7], 1)})
    analysis = analyse(observation([op], sites=[site], steps=6))
    assert next(s for s in analysis.subjects if s.kind == "op").dims[0].cause.endswith("boolean-mask")
    verdict = decide(analysis)
    assert verdict.verdict == "dynamic"
    assert any("t.py:12" in reason for reason in verdict.reasons)


def test_static_everywhere():
    op = tally("aten.mm.default", {s: [((4, 8), (8, 8))] for s in range(1, 6)})
    conv = tally("aten.convolution.default", {s: [((4, 3, 8, 8), (8, 3, 3, 3))] for s in range(1, 6)})
    verdict = decide(analyse(observation([op, conv], steps=5)))
    assert verdict.verdict == "static" and verdict.picks["cpu"] == "compile-static"
    assert any(r.target == "cuda" and "cudnn.benchmark = True" in r.setting for r in verdict.recommendations)
    assert any(r.target == "npu" and "jit_compile=True" in r.setting for r in verdict.recommendations)
    # Without a convolution cuDNN has no algorithm to choose: no cudnn.benchmark advice.
    linear = decide(analyse(observation([op], steps=5)))
    assert linear.verdict == "static" and not any(r.kind == "cudnn" for r in linear.recommendations)


def test_a_recurrent_model_with_varying_lengths_stays_eager_on_cpu_and_cuda():
    lengths = [40, 57, 64, 33, 61, 45, 64, 52]
    loader = LoaderInfo(collate="pad_collate", collate_location="t.py:9", batch_size=8, drop_last=True,
                        dataset_length=64, batches=[((8, t), (8,)) for t in lengths])
    op = tally("aten.mm.default", {s: [((8 * t, 16), (16, 48))] for s, t in enumerate(lengths, 1)})
    gru = ShapeTally(name="Net.gru", type="GRU", calls=8, signatures=[
        InputSignature(shapes=[[8, t, 16]], dtypes=["float32"], count=1) for t in lengths])
    obs = Observation(profile=profile_with_modules([gru]), ops=[op], sites=[], loaders=[loader], complete_steps=8)
    obs.profile.steps = []
    verdict = decide(analyse(obs))
    assert verdict.verdict == "dynamic"
    assert verdict.picks["cpu"] == verdict.picks["cuda"] == "eager"
    assert verdict.picks["npu"] == "jit-compile-on+bucketing"  # the NPU compiles operators, not graphs
    assert any("Net.gru (GRU)" in r and "allow_rnn" in r for r in verdict.reasons)
    cpu = {r.kind for r in verdict.recommendations if r.target == "cpu"}
    assert cpu == {"compile"}  # keep eager: no compile-dynamic, mark_dynamic or bucketing advice beside it


def test_a_batch_in_a_mapping_that_is_no_dict_is_read():
    # transformers' BatchEncoding (DataCollatorWithPadding's batches) is a UserDict: its
    # tensors went unread, and GLUE's padded batches had no cause.
    from collections import UserDict

    import torch

    from torchaxe.runtime.probes import input_signature

    batch = UserDict(input_ids=torch.zeros(8, 42, dtype=torch.long), attention_mask=torch.ones(8, 42))
    assert input_signature(batch, torch.Tensor) == (((8, 42), "int64"), ((8, 42), "float32"))
    assert input_signature((batch,), torch.Tensor) == (((8, 42), "int64"), ((8, 42), "float32"))


def chunked(lengths):
    """A recurrent language model's operators over steps with these chunk lengths
    (batch 20): the embedding sees (length, 20), the output layer (length * 20, 64)."""
    emb = tally("aten.embedding.default", {s: [((100, 16), (n, 20))] for s, n in enumerate(lengths, 1)})
    mm = tally("aten.mm.default", {s: [((n * 20, 16), (16, 64))] for s, n in enumerate(lengths, 1)})
    return [emb, mm]


def test_one_shorter_step_an_epoch_without_a_dataloader_is_the_last_chunk_not_dynamic():
    # Two epochs of 24 chunks of 35 tokens, each ending on a chunk of 34 (BPTT over a
    # token stream, no DataLoader): new shapes late in the run, but only that chunk.
    lengths = ([35] * 23 + [34]) * 2
    analysis = analyse(observation(chunked(lengths), steps=len(lengths)))
    cause = next(c for c in analysis.causes if c.kind == "last-chunk")
    assert "only 2 single steps (step 24, 48) of 47 had smaller sizes (35 -> 34)" in cause.message
    assert all(d.cause == cause.id for s in analysis.subjects for d in s.dims)
    verdict = decide(analysis)
    assert verdict.verdict == "mixed"
    assert any(r.kind == "drop-last" and "last, shorter chunk" in r.setting for r in verdict.recommendations)
    npu = next(r for r in verdict.recommendations if r.target == "npu" and r.kind != "drop-last")
    assert "jit_compile=False" not in npu.setting  # one more shape an epoch is no reason to turn it off


def test_an_operator_run_only_when_the_length_changes_does_not_decide_the_usual_size():
    # word_language_model's Transformer makes its causal mask only when the chunk length
    # changes (the first step, the short last chunk, the next epoch's first step): its
    # sizes are seen as often short as long, and that tie is no evidence that 34 is usual.
    lengths = ([35] * 23 + [34]) * 2
    changed = [s for s, n in enumerate(lengths, 1) if s == 1 or lengths[s - 2] != n]
    mask = tally("aten.tril.default", {s: [((lengths[s - 1], lengths[s - 1]),)] for s in changed})
    analysis = analyse(observation(chunked(lengths) + [mask], steps=len(lengths)))
    cause = next(c for c in analysis.causes if c.kind == "last-chunk")
    assert "(35 -> 34)" in cause.message
    assert all(d.cause == cause.id for s in analysis.subjects for d in s.dims)
    assert decide(analysis).verdict == "mixed"
    # Steps told apart by the backward pass: the short chunk's backward falls in the next
    # step's record, where the mask is made anew for the full length, so the mask is
    # seen in odd steps only; the other operators' usual sizes stand for it.
    forward = {s: 34 if s == 24 else 35 for s in range(1, 41)}
    backward = {s: 34 if s == 25 else 35 for s in range(1, 41)}
    emb = tally("aten.embedding.default", {s: [((100, 16), (n, 20))] for s, n in forward.items()})
    mm = tally("aten.mm.default", {s: [((n * 20, 64), (64, 16))] for s, n in backward.items()})
    mask = tally("aten.tril.default", {s: [((forward[s], forward[s]),)] for s in (1, 24, 25)})
    analysis = analyse(observation([emb, mm, mask], steps=40))
    assert any(c.kind == "last-chunk" and "(35 -> 34)" in c.message for c in analysis.causes)


def test_a_chunk_whose_calls_fall_in_two_steps_is_one_chunk():
    # Steps told apart by the backward pass: the short chunk's forward is in step 20,
    # its backward in the record of step 21, so two steps in a row differ.
    forward = {s: 34 if s == 20 else 35 for s in range(1, 31)}
    backward = {s: 34 if s == 21 else 35 for s in range(1, 31)}
    emb = tally("aten.embedding.default", {s: [((100, 16), (n, 20))] for s, n in forward.items()})
    mm = tally("aten.mm.default", {s: [((n * 20, 64), (64, 16))] for s, n in backward.items()})
    analysis = analyse(observation([emb, mm], steps=30))
    assert any(c.kind == "last-chunk" and "only one step (step 20)" in c.message for c in analysis.causes)
    # Three steps in a row are not one chunk.
    mm3 = tally("aten.mm.default", {s: [((34 * 20 if s in (21, 22) else 700, 64), (64, 16))] for s in range(1, 31)})
    assert not any(c.kind == "last-chunk" for c in analyse(observation([emb, mm3], steps=30)).causes)


def test_shapes_that_change_and_stay_or_grow_or_vary_often_are_not_a_last_chunk():
    for lengths in ([35] * 12 + [64] * 12,  # a curriculum: longer from step 13 on
                    [35] * 11 + [36] + [35] * 12,  # one step longer, not shorter
                    [35, 34, 35, 35, 33, 35, 35, 30, 35, 35, 31, 35] * 2):  # a shorter step every few
        analysis = analyse(observation(chunked(lengths), steps=len(lengths)))
        assert not any(c.kind == "last-chunk" for c in analysis.causes), lengths


def test_a_varying_batch_size_is_put_down_to_what_makes_the_batches():
    # Seen in a review: an IterableDataset yielding whole batches was said to have "a
    # batch sampler that groups by length".
    from torchaxe.shapes.analysis import _loader_causes

    batches = [((n, 13),) for n in (96, 512, 200, 96)]
    whole = LoaderInfo(collate="torch.utils.data.default_collate", collate_location=None, batch_size=None,
                       drop_last=None, dataset_length=None, batches=batches)
    causes, _ = _loader_causes(0, whole)
    [cause] = [c for c in causes if c.kind == "batch-size"]
    assert "batch_size=None" in cause.message and "or from a dataset that yields batches" in cause.message


def test_a_stream_cut_into_chunks_by_the_scripts_code_is_said_before_its_last_chunk_comes(tmp_path):
    """A language model's BPTT loop: the steps recorded are the first of a long epoch,
    all full chunks; the script's `min(bptt, len(source) - 1 - i)` says the last one
    will be shorter, so the static verdict says it and compiles with dynamic=False."""
    from torchaxe.shapes.stream_chunks import chunk_sites

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "def get_batch(source, i, bptt):\n"
        "    seq_len = min(bptt, len(source) - 1 - i)\n"
        "    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)\n"
        "for i in range(0, data.size(0) - 1, bptt):\n"
        "    x, y = get_batch(data, i, bptt)\n"
        "for i in range(0, len(xs), batch):\n"
        "    loss = model(xs[i:i + batch]).sum()\n"
        "    loss.backward()\n")
    sites = chunk_sites(script)
    assert [(s.line, s.text) for s in sites] == [(3, "seq_len = min(bptt, len(source) - 1 - i)"),
                                                 (7, "for i in range(0, len(xs), batch):")]
    op = tally("aten.mm.default", {s: [((35, 3), (3, 3))] for s in range(1, 6)})
    verdict = decide(analyse(observation([op], [], steps=5)), chunks=sites)
    assert verdict.verdict == "static"
    assert any("train.py:3 `seq_len = min(bptt, len(source) - 1 - i)`" in r and "last chunk is shorter" in r
               for r in verdict.reasons)
    cpu = next(r for r in verdict.recommendations if r.target == "cpu" and r.kind == "compile")
    assert cpu.setting.endswith("dynamic=False)") and "compiled once more for that chunk" in cpu.reason
    assert not any("chunk" in r for r in decide(analyse(observation([op], [], steps=5))).reasons)


def test_chunk_sites_leave_alone_divided_ends_constant_steps_and_loops_that_do_not_train(tmp_path):
    from torchaxe.shapes.stream_chunks import chunk_sites

    script = tmp_path / "train.py"
    script.write_text(
        "n = len(data) - len(data) % bptt\n"
        "for i in range(0, len(data) - len(data) % bptt, bptt):\n"
        "    model(data[i:i + bptt]).sum().backward()\n"
        "for i in range(0, len(docs), chunk):\n"
        "    embed(docs[i:i + chunk])\n"
        "for i in range(0, 10, 1):\n"
        "    model(data[i:i + 1]).sum().backward()\n"
        "k = min(bptt, 5)\n"
        "x = data[i:i + k]\n")
    assert chunk_sites(script) == []
    assert chunk_sites(tmp_path / "missing.py") == []
    (tmp_path / "bad.py").write_text("def (:\n")
    assert chunk_sites(tmp_path / "bad.py") == []


def test_a_packed_batch_varies_in_total_length_not_in_batch_size():
    # A review's text classifier (nn.EmbeddingBag with offsets): the collate function
    # concatenates 16 samples into one 1-D tensor whose length changed every batch, and
    # "the batch size varies: 20 sizes from 876 to 1260" was said, with a fixed-size
    # sampler as the fix.
    lengths = [876, 931, 1040, 1260, 990, 1102]
    loader = LoaderInfo(collate="generate_batch", collate_location="t.py:48", batch_size=16, drop_last=False,
                        dataset_length=96, batches=[((n,), (16,), (16,)) for n in lengths])
    op = tally("aten._embedding_bag.default", {s: [((100, 32), (n,), (16,))] for s, n in enumerate(lengths, 1)})
    analysis = analyse(observation([op], [loader]))
    assert [c.kind for c in analysis.causes] == ["packed"]
    packed = analysis.causes[0]
    assert "tensor 0 of each batch is one long sequence" in packed.message and "batch size is 16" in packed.message
    assert "a fixed batch size changes nothing" in packed.fix
    dims = [d for s in analysis.subjects for d in s.dims]
    assert dims and all(d.cause == packed.id for d in dims)
    assert not analysis.batch_sources  # no padding offered: it would break the offsets
