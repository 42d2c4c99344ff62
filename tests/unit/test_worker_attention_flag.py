"""``--attention-backend`` on P and D workers (pd_common/worker_runtime.py) reaches the engine config,
and ``halfmoon up --decode-args`` accepts it (bench.cpu_peer's variants compare backends with it); an
unknown backend stops the parse with the choices."""

from __future__ import annotations

import argparse

import pytest

from halfmoon.launcher import role_args
from pd_common.worker_runtime import add_common_arguments, engine_config


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_arguments(p, "decode")
    return p.parse_args(list(argv))


def test_attention_backend_reaches_the_engine_config():
    assert engine_config(parse(), rows=4).attention_backend == "auto"
    for name in ("torch_paged", "cpu_paged", "torch"):
        assert engine_config(parse("--attention-backend", name), rows=4).attention_backend == name
    assert role_args("decode", "--attention-backend=torch_paged") == ["--attention-backend=torch_paged"]


def test_unknown_backend_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--decode-args: argument --attention-backend: invalid choice"):
        role_args("decode", "--attention-backend=fast")
