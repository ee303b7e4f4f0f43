import random

from peer.registry import PeerRegistry

SELF = "http://10.0.0.9:8080"
P1 = "http://10.0.0.1:8080"
P2 = "http://10.0.0.2:8080"
P3 = "http://10.0.0.3:8080"


def test_an_empty_set_before_the_first_delivery_is_not_told_yet() -> None:
    registry = PeerRegistry(SELF)
    assert not registry.synced
    assert registry.peers == ()
    assert not registry.known_to_have_no_peers()


def test_a_synced_empty_set_with_no_history_means_no_siblings() -> None:
    registry = PeerRegistry(SELF)
    registry.replace([])
    assert registry.synced
    assert registry.known_to_have_no_peers()


def test_transient_empty_peer_set_is_not_conclusive() -> None:
    registry = PeerRegistry(SELF)
    registry.replace([P1, P2])
    registry.replace([])
    assert registry.synced and registry.ever_had_peers
    assert registry.peers == ()
    assert not registry.known_to_have_no_peers()
    registry.replace([P3])
    assert registry.peers == (P3,)


def test_a_relist_with_only_self_is_conclusively_alone() -> None:
    registry = PeerRegistry(SELF)
    registry.replace([SELF, SELF + "/"])
    assert registry.peers == ()
    assert not registry.ever_had_peers
    assert registry.known_to_have_no_peers()


def test_self_is_never_a_candidate_whatever_its_spelling() -> None:
    registry = PeerRegistry(SELF + "/")
    registry.replace([SELF, f" {SELF}/ ", P1])
    assert registry.peers == (P1,)
    assert SELF not in registry
    assert registry.candidates() == [P1]


def test_peers_are_deduplicated_trimmed_and_sorted() -> None:
    registry = PeerRegistry()
    registry.replace([P2 + "/", P1, P2, "", "/", P1 + "//"])
    assert registry.peers == (P1, P2)
    assert len(registry) == 2
    assert P2 + "/" in registry
    assert 42 not in registry


def test_peer_registry_shuffles_without_losing_entries() -> None:
    urls = [f"http://10.0.1.{i}:8080" for i in range(20)]
    registry = PeerRegistry(rng=random.Random(3))
    registry.replace(urls)
    orders = {tuple(registry.candidates()) for _ in range(10)}
    assert all(sorted(order) == sorted(urls) for order in orders)
    assert len(orders) > 1  # shuffled, not sorted every time
    assert registry.peers == tuple(sorted(urls))  # candidates() is a copy


def test_an_injected_random_source_fixes_the_candidate_order() -> None:
    one = PeerRegistry.static([P1, P2, P3], rng=random.Random(7))
    two = PeerRegistry.static([P3, P2, P1], rng=random.Random(7))
    assert [one.candidates() for _ in range(5)] == [two.candidates() for _ in range(5)]


def test_a_static_list_is_synced_from_the_start_even_when_empty() -> None:
    registry = PeerRegistry.static([P1, SELF], self_url=SELF)
    assert registry.synced and registry.ever_had_peers
    assert registry.peers == (P1,)
    alone = PeerRegistry.static([], self_url=SELF)
    assert alone.known_to_have_no_peers()


def test_version_moves_on_a_same_size_membership_swap() -> None:
    registry = PeerRegistry()
    registry.replace([P1, P2])
    seen = registry.version
    registry.replace([P1, P3])
    assert len(registry) == 2
    assert registry.version != seen


def test_version_stays_when_a_delivery_repeats_the_same_set() -> None:
    registry = PeerRegistry(SELF)
    assert registry.replace([P1, P2]) is True
    seen = registry.version
    assert registry.replace([P2, P1 + "/", SELF]) is False
    assert registry.version == seen


def test_the_first_empty_delivery_syncs_without_changing_the_set() -> None:
    registry = PeerRegistry()
    assert registry.replace([]) is False
    assert registry.synced and registry.version == 0
