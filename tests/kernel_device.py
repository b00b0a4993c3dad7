"""The device kernel tests run on: a GPU when there is one, else the CPU with
Triton's interpreter (set here, before any Triton kernel is defined)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
