"""What several test modules share: running trainflow as users do, and reading what it wrote."""
