"""The tinker-cookbook's supervised trainer, unchanged, against ``python -m areal_grpc.tinker``.

It runs ``tinker_cookbook.supervised.train.main``, the loop behind the cookbook's ``sl_basic``
recipe, on the cookbook's own example conversations (``example_data/conversations.jsonl``,
112 to train on and 16 held out). That is ``sl_basic``'s config with four changes: the
model, a renderer the model can use, a small batch, and a few checkpoints. The recipe's
command line cannot be used as it is, for two reasons:

- ``sl_basic`` looks up a "recommended renderer" for the model, and the cookbook's registry
  does not know SmolLM2 ("Unknown model");
- ``tinker_cookbook.supervised.train``'s own ``__main__`` fails in chz ("Nested entrypoints
  must take a type annotated argument", tinker-cookbook 0.5.8).

It needs the cookbook, which is not a dependency of this project. tinker-cookbook 0.6.1 needs
tml-renderers >= 0.4.1, which PyPI does not have, so install 0.5.8 in a separate venv:

    python3.11 -m venv /tmp/venv-cb
    /tmp/venv-cb/bin/pip install torch==2.13.0 tinker-cookbook==0.5.8 tinker==0.38.0

The cookbook loads the tokenizer by the model's hub name. Offline, give it one from the model
directory the service uses (``--hf-home``: this script lays out a hub cache there), then:

    TINKER_API_KEY=tml-... HF_HUB_OFFLINE=1 /tmp/venv-cb/bin/python \\
        examples/tinker_cookbook_sft.py --base-url http://127.0.0.1:8765 \\
        --model-dir ~/.cache/areal-grpc/models/SmolLM2-135M-Instruct.* --hf-home /tmp/hf \\
        --log-path /tmp/cookbook-sl

The cookbook writes its metrics to ``<log-path>/metrics.jsonl``: ``train_mean_nll`` per step
and ``test/nll`` at each evaluation.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja")


def hub_cache(model_dir: Path, hf_home: Path) -> None:
    """Lays out ``hf_home`` as a hub cache holding ``MODEL``'s tokenizer from ``model_dir``."""
    repo = hf_home / "hub" / f"models--{MODEL.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, snapshot / name)


def main() -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base-url", required=True, help="the service's TINKER http://host:port")
    parser.add_argument("--model-dir", type=Path, required=True, help="the model's directory")
    parser.add_argument("--hf-home", type=Path, required=True, help="where to lay out the cache")
    parser.add_argument("--log-path", required=True, help="the cookbook's log directory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    hub_cache(args.model_dir, args.hf_home)
    # Set before the cookbook imports transformers, which reads it once.
    os.environ["HF_HOME"] = str(args.hf_home)

    from importlib.resources import files

    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=MODEL,
        renderer_name="role_colon",
        max_length=512,
        batch_size=args.batch_size,
    )
    config = train.Config(
        log_path=args.log_path,
        model_name=MODEL,
        recipe_name="recipe_sl_basic",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(
            common_config=common, file_path=str(conversations), test_size=16
        ),
        learning_rate=2e-4,
        lr_schedule="linear",
        num_epochs=args.epochs,
        lora_rank=16,
        base_url=args.base_url,
        eval_every=7,
        save_every=7,
    )
    asyncio.run(train.main(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
