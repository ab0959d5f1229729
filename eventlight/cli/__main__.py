"""``python -m eventlight.cli``."""

from eventlight.cli.app import main

if __name__ == "__main__":
    main()
