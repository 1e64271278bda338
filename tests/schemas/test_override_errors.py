"""Bad command-line overrides and an empty config file are refused as one ConfigError naming the
field (the CLI prints it as one `error:` line), before any work starts."""

from __future__ import annotations

import pytest

from longstraw.schemas.run import ConfigError
from longstraw.train_entry import resolve_config


@pytest.mark.parametrize(
    ("option", "field"),
    [
        ({"steps": 0}, "train.num_steps"),
        ({"world_size": 0}, "parallel.world_size"),
        ({"root": "ftp://host/x"}, "storage.root_uri"),
    ],
)
def test_out_of_range_overrides_name_the_field(tmp_path, option, field):
    arguments = {"steps": None, "run_id": "o", "root": str(tmp_path), "resume": False} | option
    with pytest.raises(ConfigError, match=rf"(?s)command-line options: .*{field}") as error:
        resolve_config(None, **arguments)
    assert "Traceback" not in str(error.value)


def test_an_empty_config_file_is_refused(tmp_path):
    empty = tmp_path / "run.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"run.yaml is empty — write the run's settings"):
        resolve_config(empty, steps=None, run_id=None, root=None, resume=False)
