"""What the tests share: one definition of each helper the levels use (tests/conftest.py
holds the fixtures)."""
