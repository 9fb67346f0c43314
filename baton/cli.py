"""The `baton` command line."""


def main(argv=None) -> int:
    raise SystemExit("baton: not implemented yet")
