//! The arithmetic of the masked atomic verbs, as pure functions of the old word.
//!
//! Every backend executes masked verbs through these functions (inside a CAS loop on the CPU, or
//! on the server's verb executor), so their semantics are defined once, here, and property-tested
//! against a bit-by-bit reference.

/// The new value of a word after `masked_faa(add, boundary_mask)` on `old`.
///
/// Each set bit of `boundary_mask` marks the most significant bit of a field; a field runs from
/// its boundary bit down to (not including) the next lower boundary bit, and bit 63 always ends
/// the top field. `add` is added to every field separately: a carry out of a field's most
/// significant bit is dropped and never enters the next field. With `boundary_mask == 0` this is
/// a plain 64-bit wrapping add.
///
/// To subtract 1 from a field, add the field's all-ones value (two's complement within the field).
#[inline]
pub const fn masked_faa_result(old: u64, add: u64, boundary_mask: u64) -> u64 {
    // SWAR addition: with the top bit of every field cleared in both operands, the low bits of a
    // field can at most carry *into* the field's own top bit, never past it. The top bits are then
    // the XOR of the operands' top bits and that carry, and the carry out of them is discarded.
    let high = boundary_mask | (1 << 63);
    let low_sum = (old & !high).wrapping_add(add & !high);
    low_sum ^ ((old ^ add) & high)
}

/// Whether `masked_cas(cmp, cmp_mask, ..)` succeeds on a word holding `old`.
#[inline]
pub const fn masked_cas_matches(old: u64, cmp: u64, cmp_mask: u64) -> bool {
    old & cmp_mask == cmp & cmp_mask
}

/// The value a successful `masked_cas(.., swap, swap_mask)` stores over `old`.
#[inline]
pub const fn masked_cas_result(old: u64, swap: u64, swap_mask: u64) -> u64 {
    (old & !swap_mask) | (swap & swap_mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference: ripple-carry adder, bit by bit, with the carry killed at every boundary bit.
    fn masked_faa_reference(old: u64, add: u64, boundary: u64) -> u64 {
        let mut out = 0u64;
        let mut carry = 0u64;
        for bit in 0..64 {
            let a = (old >> bit) & 1;
            let b = (add >> bit) & 1;
            let s = a + b + carry;
            out |= (s & 1) << bit;
            carry = if (boundary >> bit) & 1 == 1 {
                0
            } else {
                s >> 1
            };
        }
        out
    }

    #[test]
    fn carry_stops_at_boundary() {
        // Two 4-bit fields in the low byte: boundary bits 3 and 7.
        let boundary = (1 << 3) | (1 << 7);
        assert_eq!(masked_faa_result(0x0F, 1, boundary), 0x00);
        assert_eq!(masked_faa_result(0xF0, 0x10, boundary), 0x00);
        assert_eq!(masked_faa_result(0x0F, 0x11, boundary), 0x10);
        // The bits above the top boundary form one more field ending at bit 63.
        assert_eq!(masked_faa_result(0xFF, 0x100, boundary), 0x1FF);
        // Subtract one from the upper field by adding its all-ones value.
        assert_eq!(masked_faa_result(0x35, 0xF0, boundary), 0x25);
    }

    #[test]
    fn zero_boundary_is_plain_add() {
        assert_eq!(masked_faa_result(u64::MAX, 1, 0), 0);
        assert_eq!(masked_faa_result(41, 1, 0), 42);
    }

    #[test]
    fn zero_compare_mask_always_succeeds() {
        assert!(masked_cas_matches(0xDEAD, 0, 0));
        assert_eq!(masked_cas_result(0xF0F0, 0x0F0F, 0x00FF), 0xF00F);
    }

    proptest! {
        #[test]
        fn masked_faa_matches_reference(old: u64, add: u64, boundary: u64) {
            prop_assert_eq!(masked_faa_result(old, add, boundary), masked_faa_reference(old, add, boundary));
        }

        #[test]
        fn masked_cas_touches_only_swap_mask(old: u64, swap: u64, mask: u64) {
            let new = masked_cas_result(old, swap, mask);
            prop_assert_eq!(new & !mask, old & !mask);
            prop_assert_eq!(new & mask, swap & mask);
        }
    }
}
