"""What a result was measured on: versions, GPU, commit (recorded with check and bench)."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess

import torch


def git_sha() -> str | None:
    """The commit measured: $FLASH_JVP_GIT_SHA (set where the tree travels without .git)."""
    if os.environ.get("FLASH_JVP_GIT_SHA"):
        return os.environ["FLASH_JVP_GIT_SHA"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        env["triton"] = md.version("triton")
    except md.PackageNotFoundError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    env["git"] = git_sha()
    return env
