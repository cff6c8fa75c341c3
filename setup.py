from setuptools import find_packages, setup

setup(
    name="megatron-dualkv",
    version="0.2.0",
    description="Shared-prompt (DualKV) packing, attention kernels and Megatron-Core models for GRPO/DAPO post-training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dualkv", "megatron_dualkv.*"]) + ["megatron_dualkv.cards", "megatron_dualkv.csrc"],
    # The model cards live in the top-level models/ folder and ship as megatron_dualkv.cards; the
    # native kernels' sources (csrc/, compiled on first use on a Hopper GPU) as megatron_dualkv.csrc.
    package_dir={"megatron_dualkv.cards": "models", "megatron_dualkv.csrc": "csrc"},
    package_data={"megatron_dualkv.cards": ["*.json"], "megatron_dualkv.csrc": ["*.cu", "*.cuh", "*.cpp", "*.h"]},
    # torch is left unpinned so GPU clusters keep their own build; on a CPU machine install the CPU
    # wheel first (README), or pip would pull a multi-GB CUDA build.
    # safetensors, tqdm: checkpoint conversion; psutil: Megatron's dist-checkpoint writer (save_model)
    install_requires=["torch>=2.4", "triton>=3.0", "megatron-core>=0.16", "numpy", "packaging", "safetensors", "tqdm", "psutil"],
    extras_require={
        # The example launch scripts (tests/test_examples.py runs them): progress bar, tokenizer,
        # psutil, which Megatron's distributed-checkpoint writer needs, TensorBoard logs
        # (--tensorboard-dir) and tools/plot_run.py's plots. Hugging Face tokenizers need transformers.
        "examples": ["tqdm", "sentencepiece", "psutil", "tensorboard", "matplotlib"],
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "transformers>=5.25", "safetensors", "sentencepiece", "tqdm", "psutil",
                 "tensorboard", "matplotlib"],
        "bench": ["matplotlib"],
        # Gated DeltaNet layers (Qwen3.5, Qwen3-Next) on CUDA: fla's chunked kernels, pinned because
        # ops/gated_delta_rule.py calls its varlen API with initial and final states
        "hybrid": ["fla-core==0.6.0"],
        # transformer-engine and apex are optional accelerators, used when present: install them the
        # way your cluster's CUDA stack requires (they do not build on CPU-only machines).
    },
)
