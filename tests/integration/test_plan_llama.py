"""benchmarks/plan_llama.py plans transformers' Llama shapes on the CPU machine (the predictions made before a GPU
run): a small shape plans, fits, counts grouped-query attention's parameters and names its device budget."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_small_llama_shape_plans_on_the_cpu(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plan_llama
    args = ["--layers", "2", "--hidden", "64", "--intermediate", "160", "--heads", "4", "--kv-heads", "2",
            "--vocab", "512", "--batch", "2", "--seq", "64", "--device-memory", "1GB"]
    report = plan_llama.main(args)
    embed, layer = 512 * 64, 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64
    assert report.params == 2 * embed + 2 * layer + 64        # embeddings, untied head, blocks, the final norm
    assert report.fits and report.device_memory == 10 ** 9 and report.tokens == 2 * 64
    assert report.model_flops > 6 * report.params * report.tokens
    assert "place_optimizer" in capsys.readouterr().out
