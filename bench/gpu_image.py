"""What the GPU machines' image already holds, so that only the rest travels as wheels.

Source: the device library's KINDS.md (nvidia-h100-x1 and nvidia-h200 share the image
'cuda'), section 'Python packages already there', as read 2026-11-17; the versions are
that file's 'pip list, as a session saw it' row (2026-11), for the packages it names,
and four read on the machine itself (see IMAGE_VERSIONS).
The machine has no network: whatever else `wire`, `kernels`, `replica`,
`speculative`, `edge_proxy` or bench/gpu_service.py import comes from
bench/gpu_wheels.txt (`bash bench/gpu_wheels.sh`, then carry `.whl`), which
tests/bench/test_gpu_wheels.py checks against this list. Names are canonical
distribution names (PEP 503: lower case, runs of `-_.` as `-`).
"""

from __future__ import annotations

PYTHON = "3.12.3"  # /opt/torch/.venv/bin/python3 on x86-64 Linux (CPython)

IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())

# The versions KINDS.md's pip list row gives (the others are unknown: any version satisfies).
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "botorch": "0.18.1", "cupy-cuda13x": "14.2.0", "gpytorch": "1.15.2",
    "huggingface-hub": "1.33.0", "jax": "0.11.2", "jaxlib": "0.11.2", "numpy": "2.5.2", "onnx": "1.23.1",
    "onnxruntime": "1.30.0", "safetensors": "0.8.0", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0",
    "transformers": "5.17.0", "triton": "3.6.0",
    # read on an nvidia-h200 by this list's first GPU check (2026-11-26, `importlib.metadata`), not in KINDS.md
    "anyio": "4.15.1", "idna": "3.19", "h11": "0.16.0", "httpx": "0.28.1",
}
