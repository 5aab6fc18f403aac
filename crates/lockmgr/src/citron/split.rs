//! Step 1 (CITRON §3.5.1, Alg. 2 l. 5): split `[l, r)` into at most `k` tree nodes that cover
//! it, minimising the covered-but-unrequested units.
//!
//! A leaf is locked through a bitmask of exactly the requested units (Alg. 2 l. 21), so a leaf
//! wastes nothing; an internal node wastes the part of its range outside `[l, r)`. The problem is
//! a tree knapsack: `best(x, j)` = least waste covering `[l, r) ∩ range(x)` with at most `j`
//! disjoint nodes of `x`'s subtree. A node fully inside `[l, r)` costs one node and no waste, a
//! node outside costs nothing; only nodes straddling `l` or `r` (at most two per level) need the
//! knapsack over their four children, so the cost is `O(k² · height)`.

use super::layout::Node;

/// The largest `k` the split supports. Solutions live in fixed-size arrays so that the knapsack
/// allocates nothing: it runs on every acquisition, and with heap-allocated tables it used to
/// cost more than the lock's two round trips on shared memory.
pub const MAX_K: usize = 4;

/// One solution: total waste and the chosen nodes (`nodes[..len]`).
#[derive(Clone, Copy, Debug)]
struct Choice {
    waste: u64,
    len: usize,
    nodes: [Node; MAX_K],
}

/// `best(x, j)` for `j = 0..=k` (`None`: impossible with `j` nodes); entries past `k` unused.
type Table = [Option<Choice>; MAX_K + 1];

const NO_NODE: Node = Node::new(0, 0);

impl Choice {
    const EMPTY: Choice = Choice {
        waste: 0,
        len: 0,
        nodes: [NO_NODE; MAX_K],
    };

    fn single(node: Node, waste: u64) -> Choice {
        let mut c = Choice::EMPTY;
        c.waste = waste;
        c.nodes[0] = node;
        c.len = 1;
        c
    }

    /// Both solutions together (callers keep `self.len + other.len <= k <= MAX_K`).
    fn join(&self, other: &Choice) -> Choice {
        let mut c = *self;
        c.waste += other.waste;
        c.nodes[c.len..c.len + other.len].copy_from_slice(&other.nodes[..other.len]);
        c.len += other.len;
        c
    }

    fn better_than(&self, other: &Choice) -> bool {
        (self.waste, self.len) < (other.waste, other.len)
    }
}

/// The nodes to lock for `[l, r)` (`l < r <= units of the tree rooted at `root``), at most `k`
/// of them (`1 <= k <= MAX_K`), sorted by ascending range start (the order Alg. 2 l. 6 locks
/// them in).
pub fn split(root: Node, l: u64, r: u64, k: usize) -> Vec<Node> {
    debug_assert!(l < r && r <= root.end() && (1..=MAX_K).contains(&k));
    let k = k.clamp(1, MAX_K);
    // Few leaves: the leaves themselves. They waste nothing, and no zero-waste cover with fewer
    // nodes exists, because an internal node lies inside [l, r) only if at least four whole
    // leaves do. This is the common case of small ranges, answered without the knapsack.
    let (first, last) = (l / 64, (r - 1) / 64);
    if last - first < k.min(3) as u64 {
        return (first..=last).map(|pos| Node::new(0, pos)).collect();
    }
    let table = best(root, l, r, k);
    let choice = table[k].expect("the root alone always covers the range");
    let mut nodes = choice.nodes[..choice.len].to_vec();
    nodes.sort_by_key(|n| n.start());
    nodes
}

/// The waste of covering `[l, r)` with `nodes` (for tests and statistics).
pub fn waste(nodes: &[Node], l: u64, r: u64) -> u64 {
    nodes
        .iter()
        .filter(|n| !n.is_leaf())
        .map(|n| n.span() - overlap(n, l, r))
        .sum()
}

fn overlap(node: &Node, l: u64, r: u64) -> u64 {
    r.min(node.end()).saturating_sub(l.max(node.start()))
}

/// `best(x, j)` for `j = 0..=k`.
fn best(node: Node, l: u64, r: u64, k: usize) -> Table {
    let inter = overlap(&node, l, r);
    if inter == 0 {
        return [Some(Choice::EMPTY); MAX_K + 1];
    }
    let single = Choice::single(
        node,
        if node.is_leaf() {
            0
        } else {
            node.span() - inter
        },
    );
    let mut out: Table = [None; MAX_K + 1];
    for slot in out.iter_mut().take(k + 1).skip(1) {
        *slot = Some(single);
    }
    if node.is_leaf() || inter == node.span() {
        return out;
    }
    // Knapsack over the four children. A child outside [l, r) adds nothing; a leaf child, or a
    // child inside [l, r), can only be taken whole at no waste; only a straddling internal child
    // (at most two per level) needs its own table.
    let mut acc: Table = [None; MAX_K + 1];
    acc[0] = Some(Choice::EMPTY);
    for i in 0..4 {
        let c = Node::new(node.hgt - 1, node.pos * 4 + i);
        let part = overlap(&c, l, r);
        if part == 0 {
            continue;
        }
        let mut next: Table = [None; MAX_K + 1];
        if c.is_leaf() || part == c.span() {
            let whole = Choice::single(c, 0);
            for a in 0..k {
                if let Some(left) = &acc[a] {
                    next[a + 1] = Some(left.join(&whole));
                }
            }
        } else {
            let sub = best(c, l, r, k);
            for (a, left) in acc.iter().enumerate().take(k + 1) {
                let Some(left) = left else { continue };
                for (b, right) in sub.iter().enumerate().take(k + 1 - a) {
                    let Some(right) = right else { continue };
                    let cand = left.join(right);
                    let slot = &mut next[a + b];
                    if slot.as_ref().is_none_or(|s| cand.better_than(s)) {
                        *slot = Some(cand);
                    }
                }
            }
        }
        acc = next;
    }
    // "At most j": make the table monotone (a solution with fewer nodes is also one with at
    // most `j`), then compare with taking the node itself.
    for j in 1..=k {
        if let Some(prev) = acc[j - 1] {
            if acc[j].as_ref().is_none_or(|s| prev.better_than(s)) {
                acc[j] = Some(prev);
            }
        }
        if let Some(cand) = acc[j] {
            let slot = &mut out[j];
            if slot.as_ref().is_none_or(|s| cand.better_than(s)) {
                *slot = Some(cand);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::citron::layout::{pow4, tree_units};
    use proptest::prelude::*;

    /// All nodes of the tree of height `h`.
    fn all_nodes(h: u32) -> Vec<Node> {
        (0..h)
            .flat_map(|hgt| (0..pow4(h - 1 - hgt)).map(move |pos| Node::new(hgt, pos)))
            .filter(|n| n.hgt < h)
            .collect()
    }

    fn disjoint(a: &Node, b: &Node) -> bool {
        a.end() <= b.start() || b.end() <= a.start()
    }

    fn covers(nodes: &[Node], l: u64, r: u64) -> bool {
        (l..r).all(|u| nodes.iter().any(|n| n.start() <= u && u < n.end()))
    }

    /// Least waste over every set of at most `k` pairwise-disjoint nodes covering `[l, r)`.
    fn brute(h: u32, l: u64, r: u64, k: usize) -> u64 {
        let nodes: Vec<Node> = all_nodes(h)
            .into_iter()
            .filter(|n| overlap(n, l, r) > 0)
            .collect();
        let mut best = u64::MAX;
        let mut stack: Vec<(usize, Vec<Node>)> = vec![(0, Vec::new())];
        while let Some((from, chosen)) = stack.pop() {
            if covers(&chosen, l, r) {
                best = best.min(waste(&chosen, l, r));
            }
            if chosen.len() == k {
                continue;
            }
            for (i, node) in nodes.iter().enumerate().skip(from) {
                if chosen.iter().all(|c| disjoint(c, node)) {
                    let mut next = chosen.clone();
                    next.push(*node);
                    stack.push((i + 1, next));
                }
            }
        }
        best
    }

    #[test]
    fn examples() {
        let root = Node::root(3);
        // Inside one leaf: the leaf.
        assert_eq!(split(root, 3, 9, 2), vec![Node::new(0, 0)]);
        // Across two leaves: both leaves, no waste.
        assert_eq!(
            split(root, 60, 70, 2),
            vec![Node::new(0, 0), Node::new(0, 1)]
        );
        // The whole tree: the root.
        assert_eq!(split(root, 0, 1024, 2), vec![root]);
        // Exactly one internal node, with fewer nodes than k: that node, in any tree.
        for h in [3, 5, 7] {
            for k in 1..=MAX_K {
                assert_eq!(split(Node::root(h), 256, 512, k), vec![Node::new(1, 1)]);
            }
        }
        // An aligned node plus a piece of a leaf.
        assert_eq!(
            split(root, 256, 520, 2),
            vec![Node::new(1, 1), Node::new(0, 8)]
        );
        // The middle of the tree with k = 1: the root (the only single cover).
        assert_eq!(split(root, 511, 513, 1), vec![root]);
        // The middle with k = 2: two leaves.
        assert_eq!(
            split(root, 511, 513, 2),
            vec![Node::new(0, 7), Node::new(0, 8)]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn matches_brute_force(h in 2u32..4, a: u64, b: u64, k in 1usize..5) {
            let n = tree_units(h);
            let l = a % n;
            let r = l + 1 + b % (n - l);
            let got = split(Node::root(h), l, r, k);
            prop_assert!(got.len() <= k);
            prop_assert!(covers(&got, l, r));
            for (i, x) in got.iter().enumerate() {
                for y in &got[i + 1..] {
                    prop_assert!(disjoint(x, y));
                    prop_assert!(x.start() < y.start());
                }
            }
            prop_assert_eq!(waste(&got, l, r), brute(h, l, r, k));
        }

        /// Leaf-aligned ranges, where whole internal nodes fit and the best answer often uses
        /// fewer than `k` nodes (uniform borders almost never produce them).
        #[test]
        fn aligned_ranges_match_brute_force(h in 2u32..4, a: u64, b: u64, k in 1usize..5) {
            let leaves = tree_units(h) / 64;
            let l = (a % leaves) * 64;
            let r = l + (1 + b % (leaves - l / 64)) * 64;
            let got = split(Node::root(h), l, r, k);
            prop_assert!(got.len() <= k && covers(&got, l, r));
            prop_assert_eq!(waste(&got, l, r), brute(h, l, r, k));
        }
    }
}
