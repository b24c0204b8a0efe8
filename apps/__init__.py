"""Recipe applications, run from the checkout (python -m apps.<app>.<step>)."""
