"""eval.layer_graphs on the CPU: the data path of a replay (inputs copied into static buffers, the layer run on them)
without the capture, which needs CUDA (the multi-GPU benchmark runs it there)."""

import torch

from eval._harness import SHAPES, build_model
from eval.layer_graphs import LayerGraphs


@torch.inference_mode()
def test_layer_graphs_give_the_eager_logits_for_new_inputs_of_one_shape():
    model = build_model(SHAPES["tiny"], "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, model.config.vocab_size, (2, 5), generator=gen) for _ in range(4)]
    eager = [model(input_ids=ids, use_cache=False).logits for ids in inputs]
    with LayerGraphs(model.model.layers) as graphs:
        wrapped = [model(input_ids=ids, use_cache=False).logits for ids in inputs]
        assert graphs.captures == len(model.model.layers)  # the second call of the signature captured each layer
    for a, b in zip(eager, wrapped, strict=True):  # the later calls ran on inputs copied into the static buffers
        torch.testing.assert_close(a, b)
    assert all("forward" not in vars(layer) for layer in model.model.layers)  # the original forwards are back


@torch.inference_mode()
def test_a_new_input_shape_gets_its_own_capture():
    model = build_model(SHAPES["tiny"], "cpu", torch.float32)
    with LayerGraphs(model.model.layers) as graphs:
        for length in (3, 3, 4, 4, 3):
            model(input_ids=torch.zeros(1, length, dtype=torch.long), use_cache=False)
        assert graphs.captures == 2 * len(model.model.layers)


def test_dense_layer_graphed_row_matches_the_eager_step():
    from eval.dense_baselines import dense_layer_graphed_row

    model = build_model(SHAPES["tiny"], "cpu", torch.float32)
    row = dense_layer_graphed_row(model, batch=2, context=64, warmup=1, repeats=2)
    assert row["max abs logit diff vs eager"] == 0.0
    assert row["layer graphs"] == len(model.model.layers) and row["devices"] == ["cpu"]
    assert row["kind"] == "dense-graphed" and row["tokens/s"] > 0
