//! Step 1 (seed 000 §3.5.1, Alg. 2 l. 5): split `[l, r)` into at most `k` tree nodes that cover
//! it, minimising the covered-but-unrequested units.
//!
//! A leaf is locked through a bitmask of exactly the requested units (Alg. 2 l. 21), so a leaf
//! wastes nothing; an internal node wastes the part of its range outside `[l, r)`. The problem is
//! a tree knapsack: `best(x, j)` = least waste covering `[l, r) ∩ range(x)` with at most `j`
//! disjoint nodes of `x`'s subtree. A node fully inside `[l, r)` costs one node and no waste, a
//! node outside costs nothing; only nodes straddling `l` or `r` (at most two per level) need the
//! knapsack over their four children, so the cost is `O(k² · height)`.

use super::layout::Node;

/// One solution: total waste and the chosen nodes.
#[derive(Clone, Debug)]
struct Choice {
    waste: u64,
    nodes: Vec<Node>,
}

impl Choice {
    fn better_than(&self, other: &Choice) -> bool {
        (self.waste, self.nodes.len()) < (other.waste, other.nodes.len())
    }
}

/// The nodes to lock for `[l, r)` (`l < r <= units of the tree rooted at `root``), at most `k`
/// of them (`k >= 1`), sorted by ascending range start (the order Alg. 2 l. 6 locks them in).
pub fn split(root: Node, l: u64, r: u64, k: usize) -> Vec<Node> {
    debug_assert!(l < r && r <= root.end() && k >= 1);
    let table = best(root, l, r, k.max(1));
    let mut nodes = table[k.max(1)]
        .clone()
        .expect("the root alone always covers the range")
        .nodes;
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

/// `best(x, j)` for `j = 0..=k` (`None`: impossible with `j` nodes).
fn best(node: Node, l: u64, r: u64, k: usize) -> Vec<Option<Choice>> {
    let inter = overlap(&node, l, r);
    let empty = Choice {
        waste: 0,
        nodes: Vec::new(),
    };
    if inter == 0 {
        return vec![Some(empty); k + 1];
    }
    let single = Choice {
        waste: if node.is_leaf() {
            0
        } else {
            node.span() - inter
        },
        nodes: vec![node],
    };
    let mut out: Vec<Option<Choice>> = vec![None; k + 1];
    for slot in out.iter_mut().skip(1) {
        *slot = Some(single.clone());
    }
    if node.is_leaf() || inter == node.span() {
        return out;
    }
    // Knapsack over the four children.
    let mut acc: Vec<Option<Choice>> = vec![None; k + 1];
    acc[0] = Some(empty);
    for i in 0..4 {
        let c = Node::new(node.hgt - 1, node.pos * 4 + i);
        let sub = best(c, l, r, k);
        let mut next: Vec<Option<Choice>> = vec![None; k + 1];
        for (a, left) in acc.iter().enumerate() {
            let Some(left) = left else { continue };
            for (b, right) in sub.iter().enumerate().take(k + 1 - a) {
                let Some(right) = right else { continue };
                let mut nodes = left.nodes.clone();
                nodes.extend_from_slice(&right.nodes);
                let cand = Choice {
                    waste: left.waste + right.waste,
                    nodes,
                };
                let slot = &mut next[a + b];
                if slot.as_ref().is_none_or(|s| cand.better_than(s)) {
                    *slot = Some(cand);
                }
            }
        }
        acc = next;
    }
    // "At most j": make the table monotone, then compare with taking the node itself.
    for j in 1..=k {
        if let Some(prev) = acc[j - 1].clone() {
            if acc[j].as_ref().is_none_or(|s| prev.better_than(s)) {
                acc[j] = Some(prev);
            }
        }
        if let Some(cand) = acc[j].take() {
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
        fn matches_brute_force(h in 2u32..4, a: u64, b: u64, k in 1usize..4) {
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
    }
}
