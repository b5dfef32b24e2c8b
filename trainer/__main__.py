"""`python -m trainer [env|check] [overrides...]`"""

from trainer.entry.cli import main

if __name__ == "__main__":
    main()
