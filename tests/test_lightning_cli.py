"""Lightning's LightningCLI on fasttrain: ``from fasttrain.lightning.cli import LightningCLI``
gives Lightning's options and config files (plus fasttrain's own options), makes a
fasttrain.lightning.Trainer, and fits as lightning.Trainer does from the same command line."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("jsonargparse")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import yaml  # noqa: E402
from lightning.pytorch.cli import LightningCLI as LightningsCLI  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from fasttrain.lightning.cli import LightningCLI, trainer  # noqa: E402
from lightning_modules import DATA, Classifier, assert_same_weights, loader  # noqa: E402

QUIET = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
         "--trainer.enable_checkpointing=false", "--seed_everything=0"]


class WithData(Classifier):
    def train_dataloader(self):
        return loader(DATA, batch_size=8, shuffle=True)


def _cli(cli_class, args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cli_class(WithData, args=args, save_config_callback=None, **kwargs)


def _printed_config(cli_class, capsys) -> dict:
    with pytest.raises(SystemExit):
        _cli(cli_class, ["fit", "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def test_the_options_are_lightnings_and_fasttrains_own(capsys):
    theirs, ours = _printed_config(LightningsCLI, capsys), _printed_config(LightningCLI, capsys)
    own = {"engine": "auto", "compile_options": None, "nonfinite": "ignore"}
    assert ours["trainer"] == {**theirs["trainer"], **own}
    assert list(ours["trainer"]) == list(theirs["trainer"]) + list(own)  # Lightning's order
    assert {k: v for k, v in ours.items() if k != "trainer"} == {k: v for k, v in theirs.items() if k != "trainer"}


def test_a_fit_from_the_command_line_is_lightnings():
    args = ["fit", "--trainer.max_epochs=2", "--model.lr=0.02", *QUIET]
    reference, ours = _cli(LightningsCLI, args), _cli(LightningCLI, args)
    assert type(ours.trainer) is Trainer
    assert ours.model.hparams.lr == 0.02
    assert ours.trainer.global_step == reference.trainer.global_step == 12
    assert_same_weights(reference.model, ours.model)
    # Lightning's own class, given fasttrain's trainer function
    theirs_with_ours = _cli(LightningsCLI, args, trainer_class=trainer)
    assert type(theirs_with_ours.trainer) is Trainer
    assert_same_weights(reference.model, theirs_with_ours.model)


def test_lightnings_config_file_runs_and_fasttrains_options_reach_the_trainer(capsys, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_printed_config(LightningsCLI, capsys)))
    cli = _cli(LightningCLI, ["fit", f"--config={config}", "--trainer.max_epochs=1", "--trainer.engine=eager", *QUIET])
    assert type(cli.trainer) is Trainer and cli.trainer._args.engine == "eager"
    assert cli.trainer.global_step == 6


def test_an_unsupported_argument_given_a_value_is_fasttrains_error():
    with pytest.raises(TypeError, match="sync_batchnorm.*convert_sync_batchnorm"):
        _cli(LightningCLI, ["fit", "--trainer.sync_batchnorm=true", *QUIET])


def test_the_trainer_takes_lightnings_defaults_of_the_arguments_it_does_not_support():
    """They ask for nothing (a dict of Lightning's defaults, a config file Lightning wrote)."""
    trainer = Trainer(sync_batchnorm=False, benchmark=None, model_registry=None, enable_autolog_hparams=True,
                      logger=False, enable_checkpointing=False)
    assert trainer.enable_autolog_hparams is True
    for name, value in (("sync_batchnorm", True), ("benchmark", True), ("model_registry", "name"),
                        ("enable_autolog_hparams", False)):
        with pytest.raises(TypeError, match=f"does not support the argument {name!r}"):
            Trainer(**{name: value})
