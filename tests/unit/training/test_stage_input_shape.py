"""A pipeline's first stage is fed the job's data in the model's input shape (`stages.load_dataset`)."""

from __future__ import annotations

import torch

from ravnest_p2p.runtime.validation import check_tensor
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stages import as_model_input, build_stage, load_dataset

MLP = {"in_features": 64, "hidden_features": [32], "out_features": 10}


def test_digits_images_reach_an_mlp_first_stage_flattened():
    for model, params in (("mlp", MLP), ("wide_mlp", {"in_features": 64, "hidden_features": [32, 32]})):
        job = JobSpec(job_id="j", model=model, model_params=params, dataset="digits")
        train, held_out = load_dataset(job)
        assert tuple(train.inputs.shape[1:]) == (64,) == tuple(held_out.inputs.shape[1:])
        stage = build_stage(job, 0, 1, max_in_flight=2)
        check_tensor(train.inputs[:32], stage.input_spec, "input")  # refused before: (32, 1, 8, 8)


def test_inputs_already_in_shape_or_of_another_size_are_left_alone():
    cnn = JobSpec(job_id="j", model="digits_cnn", dataset="digits")
    train, _ = load_dataset(cnn)
    assert tuple(train.inputs.shape[1:]) == (1, 8, 8)
    mlp = JobSpec(job_id="j", model="mlp", model_params=MLP, dataset="digits")
    odd = ArrayDataset(torch.zeros(3, 5, 5), torch.zeros(3, dtype=torch.int64))
    assert as_model_input(mlp, odd) is odd
