"""A replica's `/metrics` as a test reads it: prometheus_client's own parser, then lookups."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return cls(samples)

    def get(self, name: str, **labels: str) -> float | None:
        """One sample's value, None when the series is not exposed."""
        return self.samples.get((name, frozenset(labels.items())))

    def value(self, name: str, **labels: str) -> float:
        """One sample's value; the series must be exposed."""
        found = self.get(name, **labels)
        assert found is not None, f"{name}{labels} not exposed; have {self.names(name)}"
        return found

    def names(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for n, labels in self.samples if n == name]

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def by(self, name: str, label: str) -> dict[str, float]:
        """A labelled series as {label value: sample}, its zero samples left out."""
        return {dict(labels)[label]: v for labels, v in self.series(name).items() if v}
