"""megatron_patch: HF model families, checkpoint conversion and recipes on top of megatron-core."""
from setuptools import find_packages, setup

setup(
    name="megatron_patch",
    version="0.1.0",
    description="A non-invasive patch layer over megatron-core: model families, HF <-> Megatron "
    "checkpoint conversion, FP8 and training recipes.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_patch", "megatron_patch.*", "toolkits", "toolkits.*"]),
    package_data={"megatron_patch": ["assets/*.json", "assets/tiny_tokenizer/*.json", "assets/corpus/*"]},
    # one command for the package's tools: `megatron-patch COMMAND ...` (megatron_patch/__main__.py)
    entry_points={"console_scripts": ["megatron-patch = megatron_patch.__main__:main"]},
    install_requires=[
        "megatron-core>=0.18.2,<0.20",  # the tested range: docs/upgrading.md
        "torch>=2.6",
        "transformers>=4.51",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "sentencepiece>=0.2",
        "numpy>=1.26",
        "psutil>=5.9",
        "tqdm>=4.66",
        "einops>=0.8",  # megatron-core's dynamic inference engine (an optional import there)
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]>=2.0"],
        "lm_eval": ["lm-eval[hf]>=0.4.13,<0.5"],
        # peft < 0.23: 0.22 rewrites an MoE adapter's target_modules on transformers 5 (megatron_patch/lora/peft.py,
        # _target_modules, says how our export keeps to the modules we adapted)
        "test": ["pytest>=8.0", "ruff>=0.8", "lm-eval[hf]>=0.4.13,<0.5", "peft>=0.13,<0.23", "matplotlib>=3.8"],
    },
)
