"""Command line: ``agentmem demo`` (more commands arrive with sessions and storage)."""

from __future__ import annotations


import typer

from agentmem.errors import AgentMemError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="agentmem: resumable KV memory for agents")


@app.callback()
def main() -> None:
    """agentmem command line."""


@app.command()
def demo(
    model: str = typer.Option("embedded", help="'embedded' or a local Hugging Face model folder"),
    max_new_tokens: int = typer.Option(40, help="tokens generated per reply"),
) -> None:
    """A support conversation on the embedded model: only new tokens are read each turn,
    and the cache survives a save/restore bit-exactly without re-reading the transcript."""
    from agentmem.demo import run_demo

    try:
        run_demo(model=model, max_new_tokens=max_new_tokens, echo=typer.echo)
    except AgentMemError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


if __name__ == "__main__":
    app()
