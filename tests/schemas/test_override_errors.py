"""Bad command-line overrides and an empty config file are refused as one ConfigError naming the
field (the CLI prints it as one `error:` line), before any work starts."""

from __future__ import annotations

import pytest

from longstraw.schemas.run import ConfigError, command_line_config


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ({"train.num_steps": 0}, "train.num_steps"),
        ({"parallel.world_size": 0}, "parallel.world_size"),
        ({"storage.root_uri": "ftp://host/x"}, "storage.root_uri"),
    ],
)
def test_out_of_range_overrides_name_the_field(tmp_path, flag, field):
    flags = {"run_id": "o", "storage.root_uri": str(tmp_path)} | flag
    with pytest.raises(ConfigError, match=rf"(?s)command-line options: .*{field}") as error:
        command_line_config(None, flags)
    assert "Traceback" not in str(error.value)


def test_an_empty_config_file_is_refused(tmp_path):
    empty = tmp_path / "run.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"run.yaml is empty — write the run's settings"):
        command_line_config(empty, {})
