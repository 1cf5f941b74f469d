"""The benchmark prompts: code generation, prose, and code editing with the code given."""

from __future__ import annotations

_CLASS = """
class Inventory:
    def __init__(self, name, owner=None):
        self.name = name
        self.owner = owner
        self.items = {}
        self.history = []

    def add(self, sku, quantity, price):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        entry = self.items.get(sku)
        if entry is None:
            self.items[sku] = {"quantity": quantity, "price": price}
        else:
            entry["quantity"] += quantity
            entry["price"] = price
        self.history.append(("add", sku, quantity))

    def remove(self, sku, quantity):
        entry = self.items.get(sku)
        if entry is None or entry["quantity"] < quantity:
            raise KeyError(sku)
        entry["quantity"] -= quantity
        if entry["quantity"] == 0:
            del self.items[sku]
        self.history.append(("remove", sku, quantity))

    def total_value(self):
        return sum(e["quantity"] * e["price"] for e in self.items.values())

    def find(self, predicate):
        return [sku for sku, e in self.items.items() if predicate(e)]

    def low_stock(self, threshold=5):
        return self.find(lambda e: e["quantity"] < threshold)

    def merge(self, other):
        for sku, e in other.items.items():
            self.add(sku, e["quantity"], e["price"])
        return self

    def report(self):
        lines = [f"Inventory {self.name} ({len(self.items)} items)"]
        for sku, e in sorted(self.items.items()):
            lines.append(f"{sku}: {e['quantity']} x {e['price']:.2f}")
        lines.append(f"total: {self.total_value():.2f}")
        return "\\n".join(lines)
"""

PROMPTS = {
    "code": "Write a Python function that merges overlapping intervals, with a docstring "
    "and pytest tests.",
    "prose": "Explain in plain English how a hash table works and why lookups are fast on average.",
    "edit": "Add type hints to every method of this Python class. Reply with the whole class "
    "and nothing else.\n```python" + _CLASS + "```",
}
