import pytest

from tests.faults.cluster import greedy_references

NUM_PROMPTS = 8


@pytest.fixture(scope="session")
def references(tiny_model_dir):
    """Prompts and transformers' greedy continuation of each, shared by every fault test."""
    return greedy_references(tiny_model_dir, NUM_PROMPTS, seed=20)
