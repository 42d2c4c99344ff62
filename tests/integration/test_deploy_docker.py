"""The container images (deploy/docker): hadolint-clean, and the ones the Helm chart's defaults name.

No image is built here (no container runtime on CI); hadolint (tools/bin, `make tools`) parses and
lints both Dockerfiles, and the checks below tie them to the chart and to the package layout.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
VARIANTS = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}


def test_hadolint_passes():
    hadolint = ROOT / "tools" / "bin" / "hadolint"
    if not hadolint.exists():
        pytest.fail(f"{hadolint} missing: run `make tools` (scripts/install-tools.sh)")
    proc = subprocess.run([str(hadolint), "--no-color", *map(str, VARIANTS.values())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_chart_default_image_is_built_by_the_dockerfiles():
    values = yaml.safe_load((ROOT / "deploy" / "k8s" / "halfmoon" / "values.yaml").read_text())
    gpu = yaml.safe_load((ROOT / "deploy" / "k8s" / "halfmoon" / "values-gpu.yaml").read_text())
    assert values["image"]["repository"] == "halfmoon"
    assert {values["image"]["variant"], gpu["image"]["variant"]} == set(VARIANTS)
    for variant, path in VARIANTS.items():
        text = path.read_text()
        assert f"-t halfmoon:<version>-{variant}" in text, f"{path.name} must document the tag the chart uses"
        assert 'ENTRYPOINT ["halfmoon"]' in text
        assert "USER 1000:1000" in text  # the chart's podSecurityContext runs as uid 1000, non-root
        assert "HALFMOON_HOME=/var/cache/halfmoon" in text and values["cache"]["mountPath"] == "/var/cache/halfmoon"


def test_images_copy_every_package_of_the_distribution():
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r'include = \[([^\]]*)\]', pyproject).group(1)
    packages = {p.strip().strip('"').rstrip("*") for p in include.split(",") if p.strip()}
    for path in VARIANTS.values():
        copied = set(re.findall(r"^COPY (\w+) \./\1$", path.read_text(), flags=re.M))
        assert packages <= copied, f"{path.name} misses {packages - copied}"
        ignore = (path.parent / f"{path.name}.dockerignore").read_text()
        assert all(f"!{p}/" in ignore for p in packages), f"{path.name}.dockerignore hides a package"
