//! Prints `model::math::PINNED` and `PINNED_LN_1P` recomputed by the current
//! formulas, in source form, for a deliberate change of `exp`/`ln_1p` made on the
//! CPU and in `scoria_math.cuh` together. Inputs are the tables' own `x` values;
//! to pin a new input, add a row with any outputs and run this.
//!
//!   cargo run -p scoria-model --example pinned_tables

use model::math::{exp, ln_1p, sigmoid, silu, softplus, PINNED, PINNED_LN_1P};

fn main() {
    let b = |v: f32| v.to_bits();
    println!("pub const PINNED: &[Pinned] = &[");
    for p in PINNED {
        let x = f32::from_bits(p.x);
        println!(
            "    Pinned {{ x: {:#010x}, exp: {:#010x}, sigmoid: {:#010x}, silu: {:#010x}, softplus: {:#010x} }}, // {x:e}",
            p.x, b(exp(x)), b(sigmoid(x)), b(silu(x)), b(softplus(x))
        );
    }
    println!("];\n\npub const PINNED_LN_1P: &[(u32, u32)] = &[");
    for &(xb, _) in PINNED_LN_1P {
        let x = f32::from_bits(xb);
        println!("    ({xb:#010x}, {:#010x}), // {x:e}", b(ln_1p(x)));
    }
    println!("];");
}
